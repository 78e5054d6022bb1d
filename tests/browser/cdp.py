"""A small Chrome DevTools Protocol client for the browser test: start headless Chromium, drive
one page (navigate, click, evaluate, screenshot) and collect what its console reports.

https://chromedevtools.github.io/devtools-protocol/ : the browser writes its DevTools port to
``<user-data-dir>/DevToolsActivePort``; ``/json/list`` names the page's websocket; commands are
JSON ``{"id", "method", "params"}`` answered by ``{"id", "result"}``, with events in between.
Console errors come from three events: ``Runtime.consoleAPICalled`` (``console.error``),
``Runtime.exceptionThrown`` (an uncaught script error) and ``Log.entryAdded`` (the browser's own
messages: a resource that failed to load, a Content-Security-Policy violation).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from typing import Any


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


class Browser:
    """One headless Chromium process with one page; ``close()`` kills it by its pid."""

    def __init__(self, executable: str, *, width: int = 1280, height: int = 900, timeout: float = 30.0) -> None:
        from websockets.sync.client import connect

        self.profile = tempfile.mkdtemp(prefix="featurestore-chromium-")
        self._stack = contextlib.ExitStack()
        self.width, self.height, self.timeout = width, height, timeout
        self.proc = subprocess.Popen(
            [executable, "--headless", "--disable-gpu", "--no-sandbox", "--no-first-run",
             "--no-default-browser-check", "--disable-extensions", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--metrics-recording-only",
             f"--user-data-dir={self.profile}", "--remote-debugging-port=0",
             f"--window-size={width},{height}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            start_new_session=True,  # its own process group: close() ends renderer and helpers too
        )  # fmt: skip
        try:
            port = self._devtools_port()
            pages = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10).read())
            page = next(p for p in pages if p.get("type") == "page")
            self.ws = self._stack.enter_context(connect(page["webSocketDebuggerUrl"], max_size=64 << 20, open_timeout=10))
        except Exception:
            self.close()
            raise
        self._next = 0
        self.events: list[dict[str, Any]] = []
        for domain in ("Page", "Runtime", "Log", "Network"):
            self.send(f"{domain}.enable")

    def _devtools_port(self) -> int:
        marker = os.path.join(self.profile, "DevToolsActivePort")
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                raise RuntimeError(f"chromium exited with {self.proc.returncode}: {err[-1500:]}")
            try:
                with open(marker) as f:
                    return int(f.readline())
            except (OSError, ValueError):
                time.sleep(0.05)
        raise RuntimeError(f"chromium wrote no DevToolsActivePort within {self.timeout} s")

    # ------------------------------------------------------------------ protocol
    def send(self, method: str, **params: Any) -> dict[str, Any]:
        self._next += 1
        ident = self._next
        self.ws.send(json.dumps({"id": ident, "method": method, "params": params}))
        deadline = time.monotonic() + self.timeout
        while True:
            message = json.loads(self.ws.recv(timeout=max(0.1, deadline - time.monotonic())))
            if message.get("id") == ident:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return dict(message.get("result", {}))
            self.events.append(message)

    def wait_for(self, method: str) -> dict[str, Any]:
        """The next event ``method`` (earlier events stay in ``events``)."""
        deadline = time.monotonic() + self.timeout
        seen = len(self.events)
        while True:
            for event in self.events[seen:]:
                if event.get("method") == method:
                    self.events.remove(event)
                    return event
            seen = len(self.events)
            message = json.loads(self.ws.recv(timeout=max(0.1, deadline - time.monotonic())))
            self.events.append(message)

    # ------------------------------------------------------------------ page
    def _settle(self) -> None:
        """After a load: wait until the document and its images are complete."""
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            done = self.evaluate("document.readyState === 'complete' && "
                                 "Array.from(document.images).every(i => i.complete)")  # fmt: skip
            if done:
                return
            time.sleep(0.05)
        raise TimeoutError(f"page not complete after {self.timeout} s")

    def navigate(self, url: str) -> None:
        self.events.clear()
        self.send("Page.navigate", url=url)
        self.wait_for("Page.loadEventFired")
        self._settle()

    def click(self, selector: str) -> None:
        """Click the first element matching ``selector`` and wait for the page it leads to."""
        self.events.clear()
        found = self.evaluate(f"(() => {{ const e = document.querySelector({json.dumps(selector)}); "
                              "if (!e) return false; e.click(); return true; })()")  # fmt: skip
        if not found:
            raise AssertionError(f"no element matches {selector!r} on {self.url()}")
        self.wait_for("Page.loadEventFired")
        self._settle()

    def evaluate(self, expression: str) -> Any:
        result = self.send("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression!r} threw: {result['exceptionDetails']}")
        return result["result"].get("value")

    def url(self) -> str:
        return str(self.evaluate("location.href"))

    def console_errors(self) -> list[str]:
        """What the page's console showed as errors since the last navigation."""
        errors = []
        for event in self.events:
            method, params = event.get("method"), event.get("params", {})
            if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
                errors.append("console: " + " ".join(str(a.get("value", a.get("description"))) for a in params.get("args", [])))
            elif method == "Runtime.exceptionThrown":
                errors.append("exception: " + str(params.get("exceptionDetails", {}).get("text")))
            elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
                entry = params["entry"]
                errors.append(f"{entry.get('source')}: {entry.get('text')} {entry.get('url', '')}".strip())
        return errors

    def screenshot(self, path: str, full_page: bool = True) -> bytes:
        """A PNG of the page (its whole height when ``full_page``), written to ``path``."""
        height = self.height
        if full_page:
            metrics = self.send("Page.getLayoutMetrics")
            height = int(min(max(metrics["cssContentSize"]["height"], self.height), 6000))
        self.send("Emulation.setDeviceMetricsOverride", width=self.width, height=height,
                  deviceScaleFactor=1, mobile=False)  # fmt: skip
        data = base64.b64decode(self.send("Page.captureScreenshot", format="png")["data"])
        self.send("Emulation.clearDeviceMetricsOverride")
        with open(path, "wb") as f:
            f.write(data)
        return data

    def close(self) -> None:
        self._stack.close()  # the websocket
        try:  # the group this browser leads (its renderer, zygote and GPU helpers), by its id
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)
        if self.proc.stderr:
            self.proc.stderr.close()
        shutil.rmtree(self.profile, ignore_errors=True)

"""``bench s3 --link-gbit``: a link of a set speed between the bench and its server, in a private
network namespace (featurestore.testing.netlink). Real namespaces and ``tc``; needs root."""

from __future__ import annotations

import http.server
import os
import shutil
import subprocess
import threading
import time
import urllib.request

import pytest

from featurestore.testing import netlink as link
from featurestore.cli import main
from featurestore.errors import InvalidOption

PAYLOAD = 4 << 20  # 4 MiB: ~1 ms over bare loopback, 0.34 s over 0.1 Gbit/s


def _root_with_tools() -> str | None:
    if os.geteuid() != 0:
        return "needs root (a network namespace and tc)"
    if shutil.which("tc") is None or shutil.which("ip") is None:
        return "needs iproute2's tc and ip"
    return None


def _can_isolate() -> str | None:
    missing = _root_with_tools()
    if missing is not None:
        return missing
    if shutil.which("unshare") is None:
        return "needs util-linux's unshare to see whether namespaces can be made here"
    # What the bench needs, tried in a throwaway namespace: root without CAP_SYS_ADMIN (a
    # container) cannot make one (that refusal is tested below), a kernel may lack HTB.
    probe = subprocess.run(["unshare", "--net", "sh", "-c", "ip link set lo up && tc qdisc add dev lo root handle 1: htb"],
                           capture_output=True, text=True, check=False)
    if probe.returncode != 0:
        return f"cannot make a shaped network namespace here ({probe.stderr.strip()})"
    return None


_CANNOT_ISOLATE = _can_isolate()
needs_isolation = pytest.mark.skipif(_CANNOT_ISOLATE is not None, reason=str(_CANNOT_ISOLATE))


def _host_qdiscs() -> str:
    return subprocess.run(["tc", "qdisc", "show", "dev", "lo"], capture_output=True, text=True, check=True).stdout


def download_seconds(gbit: float | None) -> tuple[float, str, str]:
    """Run in the isolated child: serve PAYLOAD bytes on 127.0.0.1, shape the port to ``gbit``
    (None: unshaped), download them; (seconds, link description, this namespace's qdiscs)."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            self.send_response(200)
            self.send_header("Content-Length", str(PAYLOAD))
            self.end_headers()
            self.wfile.write(bytes(PAYLOAD))

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    described = link.shape(port, gbit) if gbit is not None else ""
    t0 = time.perf_counter()
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=30) as response:
        got = len(response.read())
    seconds = time.perf_counter() - t0
    server.shutdown()
    assert got == PAYLOAD
    return seconds, described, _host_qdiscs()


@needs_isolation
def test_the_link_shapes_the_port_in_a_namespace_of_its_own() -> None:
    before = _host_qdiscs()
    bare = link.run_isolated(download_seconds, None)[0]
    seconds, described, inside = link.run_isolated(download_seconds, 0.1)
    expected = PAYLOAD * 8 / 0.1e9  # 0.34 s
    assert seconds > 0.6 * expected and bare < 0.2 * expected, (seconds, bare)
    assert "0.1 Gbit/s" in described and "htb" in inside  # shaped in the child's namespace...
    assert _host_qdiscs() == before  # ...and the host's loopback never changed


def test_shape_refuses_to_touch_the_loopback_it_runs_on() -> None:
    with pytest.raises(RuntimeError, match="run_isolated"):
        link.shape(9, 1.0)


@needs_isolation
def test_an_error_in_the_child_comes_back_with_its_traceback() -> None:
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        link.run_isolated(_divide, 0)


def _divide(value: int) -> float:
    return 1 / value


@needs_isolation
def test_the_benchs_own_errors_come_back_as_they_are() -> None:
    with pytest.raises(InvalidOption, match="no such thing"):
        link.run_isolated(_refuse, "no such thing")


def _refuse(message: str) -> None:
    raise InvalidOption(message)


@pytest.mark.parametrize("argv, message", [
    (["--link-gbit", "10", "--endpoint", "http://127.0.0.1:9"], "leave it out with --endpoint"),
    (["--link-gbit", "0"], "must be a positive speed"),
])
def test_bad_link_flags_are_one_line(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["bench", "s3", *argv])
    err = capsys.readouterr().err
    assert status != 0 and message in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.skipif(_root_with_tools() is not None, reason=str(_root_with_tools()))
@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs util-linux's setpriv")
def test_without_the_right_to_a_namespace_it_says_so_in_one_line() -> None:
    import sys

    # Root without CAP_SYS_ADMIN: unshare(CLONE_NEWNET) is refused, as for any other user.
    code = "from featurestore.cli import main; raise SystemExit(main(['bench', 's3', '--link-gbit', '10']))"
    proc = subprocess.run(["setpriv", "--bounding-set=-sys_admin", "--inh-caps=-sys_admin", sys.executable, "-c", code],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--link-gbit needs root" in lines[0] and "Operation not permitted" in lines[0], lines

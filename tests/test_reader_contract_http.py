"""The reader contract (tests/reader_contract.py) for ``RemoteFeatureArray``: the same read tests
as every local and object-storage reader, through the HTTP server.

The store is served in-process (``TestClient(create_app(store))`` handed to ``FeatureClient``),
so each test opens its own freshly written store in milliseconds; the real ``featurestore serve``
process and the real transport are exercised by tests/test_client_http.py,
tests/test_client_http_transport.py and tests/test_faults_server.py.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from fastapi.testclient import TestClient  # noqa: E402

from client import FeatureClient  # noqa: E402
from featurestore.core.protocol import ArrayReader  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from reader_contract import ReaderContract  # noqa: E402
from server import Settings, create_app  # noqa: E402


class TestHTTPReader(ReaderContract):
    def location(self, request: pytest.FixtureRequest, tmp_path: Any) -> tuple[str, dict[str, Any]]:
        return str(tmp_path / "store"), {}

    def open_reader(self, url: str, options: dict[str, Any], dataset: str, encoder: str, split: str,
                    request: pytest.FixtureRequest) -> ArrayReader:  # fmt: skip
        # A small byte cap, so multi-request reads (split by the client) are part of the contract.
        app = create_app(url, Settings(max_response_bytes=1024))
        http = TestClient(app)
        request.addfinalizer(http.close)
        return FeatureClient("http://testserver", retries=0, http_client=http).open(dataset, encoder, split)


class TestHTTPReaderWithoutCap(TestHTTPReader):
    def open_reader(self, url: str, options: dict[str, Any], dataset: str, encoder: str, split: str,
                    request: pytest.FixtureRequest) -> ArrayReader:  # fmt: skip
        http = TestClient(create_app(url, Settings()))
        request.addfinalizer(http.close)
        return FeatureClient("http://testserver", retries=0, http_client=http).open(dataset, encoder, split)

"""The bag contract (tests/bag_contract.py) for ``RemoteBagArray``: the same bag reads as the local and
object-storage bag readers, through the HTTP server (``FeatureClient.open_bags``).

Served in-process (``TestClient(create_app(store))`` handed to ``FeatureClient``), once with a byte
cap of a few patches, so a bag read in several row-range requests is part of the contract; the real
``featurestore serve`` process is exercised by tests/test_server_bags.py.
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
from server import Settings, create_app  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from bag_contract import BagContract  # noqa: E402


class TestHTTPBags(BagContract):
    max_response_bytes = 100  # a few patches per request: "../x" (37 patches) takes several

    def location(self, request: pytest.FixtureRequest, tmp_path: Any) -> tuple[str, dict[str, Any]]:
        return str(tmp_path / "store"), {}

    def open_bags(self, url: str, options: dict[str, Any], request: pytest.FixtureRequest) -> Any:
        http = TestClient(create_app(url, Settings(max_response_bytes=self.max_response_bytes)))
        request.addfinalizer(http.close)
        return FeatureClient("http://testserver", retries=0, http_client=http).open_bags("ds", "enc", "bags")


class TestHTTPBagsWithoutCap(TestHTTPBags):
    max_response_bytes = Settings().max_response_bytes

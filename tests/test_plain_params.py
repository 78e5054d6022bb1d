"""``server.plain_params.PlainParamsRoute``: the data routes read their parameters without FastAPI's
dependency solver, and answer every input exactly as FastAPI's solver did (values, the 400s and
their messages, the OpenAPI schema)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from typing import Annotated, Any

import pytest

pytest.importorskip("fastapi")
from fastapi import APIRouter, FastAPI, Header, Query, Request
from fastapi.responses import JSONResponse
from fastapi.testclient import TestClient

from server import create_app
from server.errors import install_error_handlers
from server.plain_params import PlainParamsRoute

sys.path.insert(0, os.path.dirname(__file__))
from _server_fixtures import make_store


def _endpoint(request: Request, name: str, index: int,
              start: Annotated[int, Query(description="first")],
              flag: Annotated[bool, Query(description="a flag")] = False,
              dtype: Annotated[str | None, Query()] = None,
              accept: Annotated[str | None, Header()] = None,
              x_thing: Annotated[str | None, Header()] = None) -> JSONResponse:  # fmt: skip
    return JSONResponse({"path": request.url.path, "name": name, "index": index, "start": start, "flag": flag,
                         "dtype": dtype, "accept": accept, "x_thing": x_thing})  # fmt: skip


def _app(route_class: type) -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)
    router = APIRouter(route_class=route_class)
    router.add_api_route("/r/{name}/{index}", _endpoint, methods=["GET"])
    app.include_router(router)
    return app


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[TestClient, TestClient]]:
    from fastapi.routing import APIRoute

    with TestClient(_app(APIRoute)) as fastapi_own, TestClient(_app(PlainParamsRoute)) as plain:
        yield fastapi_own, plain


CASES: list[tuple[str, dict[str, str]]] = [
    ("/r/a/5?start=0", {}),
    ("/r/a%20b/05?start=-3&flag=true&dtype=float16", {"Accept": "application/x-npy", "X-Thing": "t"}),
    ("/r/a/+5?start=1_0&flag=True&flag=0", {}),          # pydantic's lax spellings; the last flag wins
    ("/r/a/%20%207?start=%2B2&flag=yes", {}),
    ("/r/a/1e3?start=0", {}),                            # not an integer
    ("/r/a/%D9%A3?start=0", {}),                         # a non-ASCII digit
    ("/r/a/99999999999999999999999?start=0", {}),        # beyond int64: still an int here, the route checks bounds
    ("/r/a/5", {}),                                      # a required query parameter missing
    ("/r/a/x?flag=maybe", {}),                           # several problems: every one named
    ("/r/a/5?start=0&flag=&dtype=", {"Accept": ""}),    # empty values
    ("/r/a/5?start=0&dtype=a&dtype=b", {}),
]


@pytest.mark.parametrize(("target", "headers"), CASES)
def test_answers_as_fastapi_does(pair: tuple[TestClient, TestClient], target: str, headers: dict[str, str]) -> None:
    fastapi_own, plain = pair
    want, got = fastapi_own.get(target, headers=headers), plain.get(target, headers=headers)
    assert (got.status_code, got.json()) == (want.status_code, want.json())


def test_bad_values_are_one_400_naming_each(pair: tuple[TestClient, TestClient]) -> None:
    answer = pair[1].get("/r/a/x?flag=maybe")
    assert answer.status_code == 400
    detail = answer.json()["detail"]
    assert "path.index" in detail and "query.start: Field required" in detail and "query.flag" in detail


def test_openapi_schema_is_unchanged(pair: tuple[TestClient, TestClient]) -> None:
    fastapi_own, plain = pair
    assert plain.get("/openapi.json").json() == fastapi_own.get("/openapi.json").json()


def test_an_endpoint_it_cannot_serve_is_refused_at_build_time() -> None:
    router = APIRouter(route_class=PlainParamsRoute)
    with pytest.raises(TypeError, match="only str, int, bool"):
        router.add_api_route("/f/{x}", lambda x: JSONResponse({}), methods=["GET"])  # untyped: Any
    with pytest.raises(TypeError, match="more than plain parameters"):
        router.add_api_route("/b", _with_body, methods=["POST"])


def test_a_fastapi_whose_internals_moved_falls_back_to_its_solver(monkeypatch: pytest.MonkeyPatch,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    import server.plain_params as plain

    def moved(field: Any, where: str) -> Any:
        raise AttributeError("'ModelField' object has no attribute 'field_info'")

    monkeypatch.setattr(plain, "_reader", moved)
    app = FastAPI()
    router = APIRouter(route_class=PlainParamsRoute)
    router.add_api_route("/f/{x}", _echo, methods=["GET"])
    app.include_router(router)
    with caplog.at_level("WARNING", logger="server.plain_params"), TestClient(app) as client:
        assert client.get("/f/7", params={"flag": "true"}).json() == {"x": 7, "flag": True}
        assert client.get("/f/seven").status_code == 422  # FastAPI's own validation answers
    assert "FastAPI's solver" in caplog.text


def _echo(x: int, flag: bool = False) -> JSONResponse:
    return JSONResponse({"x": x, "flag": flag})


def _with_body(body: dict[str, Any]) -> JSONResponse:
    return JSONResponse(body)


def test_data_routes_skip_fastapis_dependency_solver(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The solver was a third of the single item's event-loop time (cProfile, in-process); the
    data routes must not take it. Every other route still does."""
    import fastapi.routing

    calls: list[str] = []
    real = fastapi.routing.solve_dependencies

    async def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs["request"].url.path)
        return await real(*args, **kwargs)

    monkeypatch.setattr(fastapi.routing, "solve_dependencies", counting)
    base = "/v1/features/pannuke/tiny/train"
    with TestClient(create_app(make_store(str(tmp_path / "store")))) as client:
        assert client.get(f"{base}/items/3").status_code == 200
        assert client.get(f"{base}/batch?start=0&stop=2&labels=true").status_code == 200
        assert client.post(f"{base}/batch", json={"indices": [1, 1]}).status_code == 200
        assert client.get(f"{base}/items/x").status_code == 400
        assert calls == []
        assert client.get("/v1/datasets").status_code == 200
        assert calls == ["/v1/datasets"]

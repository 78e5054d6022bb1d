"""``PlainParamsRoute``: a FastAPI route whose parameters are read without FastAPI's dependency solver.

Why: FastAPI resolves an endpoint's parameters per request through its generic dependency machinery
(for every parameter: the annotation inspected again, the value validated by pydantic, the
errors gathered), about 250 ``isinstance`` calls for the seven parameters of the single-item
route: in a cProfile of that route in-process it was a third of the event loop's time per
request, more than the gather of the 192 KiB sample itself. The data routes only take strings,
integers, booleans and optional strings from the path, the query and the headers, so this route
class reads them directly (a well-formed integer or boolean with one ``int()`` or a comparison;
anything else through pydantic, so odd inputs are accepted or refused exactly as FastAPI would,
with the same message, answered 400 by ``server/errors.py``).

Everything else is FastAPI's: the signature still declares the parameters (the OpenAPI schema and
``/docs`` come from it as before), routing, the exception handlers, the thread pool for a
``def`` endpoint. A route whose endpoint needs more (a dependency, a body model, a cookie) is
refused when the app is built, not served differently. The class reads FastAPI's own description
of the endpoint (``APIRoute.dependant``); should a FastAPI release rename what it reads, the route
falls back to FastAPI's solver with a warning (slower, same answers) rather than fail to start.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import TypeAdapter, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response

_ADAPTERS = {int: TypeAdapter(int), bool: TypeAdapter(bool)}
_OPTIONAL_STR = str | None
_MISSING = object()
_log = logging.getLogger(__name__)


def _convert(annotation: Any, value: str) -> Any:
    """``value`` as ``annotation``: the common well-formed spellings directly, the rest as
    pydantic's lax mode (FastAPI's) takes or refuses it."""
    if annotation is str or annotation == _OPTIONAL_STR:
        return value
    if annotation is int and value.isascii() and value.isdigit():
        return int(value)
    if annotation is bool and value in ("true", "false"):
        return value == "true"
    return _ADAPTERS[annotation].validate_python(value)


def _reader(field: Any, where: str) -> Callable[[Request], Any]:
    """``request -> value`` of one declared parameter (``where``: path, query or header)."""
    info = field.field_info
    annotation = info.annotation
    if annotation not in (str, int, bool) and annotation != _OPTIONAL_STR:
        raise TypeError(f"PlainParamsRoute: parameter {field.name!r} is {annotation!r}; "
                        "only str, int, bool and str | None are read without FastAPI")  # fmt: skip
    alias = field.alias
    if where == "header" and getattr(info, "convert_underscores", True) and alias == field.name:
        alias = alias.replace("_", "-")  # as FastAPI names header parameters
    required = info.is_required()
    default = None if required else info.get_default()

    def read(request: Request) -> Any:
        if where == "path":
            value = request.path_params.get(alias, _MISSING)
        elif where == "query":
            value = request.query_params.get(alias, _MISSING)
        else:
            value = request.headers.get(alias, _MISSING)
        if value is _MISSING:
            if required:
                raise _Invalid([{"type": "missing", "loc": (where, alias), "msg": "Field required", "input": None}])
            return default
        try:
            return _convert(annotation, value)
        except ValidationError as error:
            raise _Invalid([{**problem, "loc": (where, alias)} for problem in error.errors()]) from None

    return read


class _Invalid(Exception):
    def __init__(self, errors: list[dict[str, Any]]) -> None:
        self.errors = errors


class PlainParamsRoute(APIRoute):
    """An ``APIRoute`` whose endpoint takes ``request: Request`` and plain path, query and header
    parameters only (``str``, ``int``, ``bool``, ``str | None``) and returns a ``Response``."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        try:
            return self._plain_handler()
        except AttributeError as error:  # a FastAPI whose internals moved: its own solver still works
            _log.warning("PlainParamsRoute %s: FastAPI's endpoint description changed (%s); "
                         "parameters go through FastAPI's solver", self.path, error)
            return super().get_route_handler()

    def _plain_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        dependant = self.dependant
        extra = (dependant.dependencies or dependant.body_params or dependant.cookie_params
                 or dependant.background_tasks_param_name or dependant.response_param_name)  # fmt: skip
        if extra:
            raise TypeError(f"PlainParamsRoute {self.path}: the endpoint needs more than plain parameters")
        readers = [(field.name, _reader(field, where))
                   for where, fields in (("path", dependant.path_params), ("query", dependant.query_params),
                                         ("header", dependant.header_params))
                   for field in fields]  # fmt: skip
        request_name = dependant.request_param_name
        call = dependant.call
        assert call is not None
        is_async = inspect.iscoroutinefunction(call)

        async def handler(request: Request) -> Response:
            values: dict[str, Any] = {request_name: request} if request_name else {}
            problems: list[dict[str, Any]] = []
            for name, read in readers:  # every parameter read, so one 400 names every problem
                try:
                    values[name] = read(request)
                except _Invalid as invalid:
                    problems.extend(invalid.errors)
            if problems:
                raise RequestValidationError(problems)
            response = await call(**values) if is_async else await run_in_threadpool(call, **values)
            if not isinstance(response, Response):
                raise TypeError(f"PlainParamsRoute {self.path}: the endpoint must return a Response")
            return response

        return handler


__all__ = ["PlainParamsRoute"]

"""Every error leaves in the caller's API shape: OpenAI's on /v1, the Workers-AI envelope on /ai/run.

Unexpected exceptions are answered by `NodeMiddleware` (a generic 500 naming the request id), not here:
Starlette's handler for `Exception` re-raises after answering, which resets the connection."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.routing import Match

from edgeinfer.api.errors import ApiError, bad_request, body_too_large
from edgeinfer.types.validation import InvalidInput

_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")
# Where FastAPI found a value: the first part of an error's `loc`.
_SOURCES = ("body", "query", "path", "header", "cookie")


def install(app: FastAPI) -> None:
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)


async def _api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    return exc.response(request.url.path)


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    """Every validation error is a 400 naming the first bad field in `param`, as OpenAI and vLLM answer
    (FastAPI's own default is a 422): invalid JSON, wrong types, values out of range."""
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    if first.get("type") == "json_invalid":
        error = bad_request(f"invalid JSON body: {first.get('ctx', {}).get('error', first['msg'])}")
    else:
        where = _field(first["loc"])
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        own = first.get("ctx", {}).get("error")
        # Our own checks (types/validation.py) name the field in their message: it is given as it is.
        message = str(own) if isinstance(own, InvalidInput) else f"{where}: {first['msg']}"
        error = bad_request(f"{message}{more}", param=where)
    return error.response(request.url.path)


def _field(loc: Sequence[Any]) -> str:
    """`messages.0.role` for FastAPI's `("body", "messages", 0, "role")`; a query or path parameter by its
    name; the whole body as `body`."""
    parts = list(loc[1:] if loc and loc[0] in _SOURCES else loc)
    return ".".join(str(part) for part in parts) or "body"


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 413:
        error = body_too_large(str(exc.detail))
    else:
        code = {404: "not_found", 405: "method_not_allowed", 408: "request_timeout"}.get(exc.status_code)
        error = ApiError(exc.status_code, str(exc.detail), code=code)
    response = error.response(request.url.path)
    response.headers.update(exc.headers or {})
    if exc.status_code == 405:
        response.headers["allow"] = _allowed_methods(request)
    return response


def _allowed_methods(request: Request) -> str:
    """Every method some route takes at this path, for a 405's Allow header (RFC 9110 requires it):
    Starlette names only those of the first route matching the path, where a path may have a route per
    method. Asked of the routes as they are (FastAPI wraps included routers), one method at a time."""
    routes = request.app.routes
    allowed = [
        method
        for method in _METHODS
        if any(route.matches({**request.scope, "method": method})[0] == Match.FULL for route in routes)
    ]
    return ", ".join(allowed)

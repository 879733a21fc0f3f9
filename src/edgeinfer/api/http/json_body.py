"""JSON request bodies parsed with a bounded nesting depth (types/bounded_json.py), for the node's and the
router's routes: a body nested deeper than MAX_JSON_DEPTH is FastAPI's invalid-JSON error, which the error
handlers answer with 400 in the route's shape, before anything walks it."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute

from edgeinfer.types import bounded_json


class BoundedJSONRequest(Request):
    """A request whose `json()` is `bounded_json.loads` (FastAPI reads bodies through it)."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = bounded_json.loads(await self.body())
        return self._json


class BoundedJSONRoute(APIRoute):
    """A route that hands its endpoint (and FastAPI's body parsing) a `BoundedJSONRequest`."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def bounded(request: Request) -> Response:
            return await handler(BoundedJSONRequest(request.scope, request.receive))

        return bounded

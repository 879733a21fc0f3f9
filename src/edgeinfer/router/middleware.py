"""Pure ASGI middleware (streams pass untouched): a request id on every request and response, and a generic
500 in OpenAI's shape for an unexpected error, as the node's middleware does.

The id is the client's own `x-request-id` when it is tame (api/http/request_ids.py), else a new one; it
replaces the client's header in the request, so the node it is forwarded to logs it under the same id.
An error escaping the app would otherwise reach Starlette's outermost handler, which answers a plain-text
500 and re-raises, and uvicorn then closes the client's keep-alive connection.
"""

from __future__ import annotations

import logging

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from edgeinfer.api.errors import unexpected
from edgeinfer.api.http.request_ids import request_id_of

logger = logging.getLogger("edgeinfer.router")
_HEADER = b"x-request-id"


class RequestIds:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = request_id_of(scope)
        stamp = (_HEADER, request_id.encode())
        scope["headers"] = [(k, v) for k, v in scope.get("headers", []) if k != _HEADER] + [stamp]
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != _HEADER]
                message = {**message, "headers": [*headers, stamp]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            logger.exception("unhandled error on %s (request id %s)", scope.get("path"), request_id)
            if not started:  # once a response started, the server can only close the connection
                await unexpected(request_id).response(scope.get("path", ""))(scope, receive, send_with_id)

"""Pure ASGI middleware (streams pass untouched): the node's request-body limit, enforced while the body
is read, so an oversized body gets the node's 413 without being buffered or forwarded. Being the first to
see each request, it also stamps its arrival (`request.state.arrived`, monotonic seconds): the router's
latency metrics start there, before the body is read and validated."""

from __future__ import annotations

import time

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class BodyLimit:
    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scope.setdefault("state", {})["arrived"] = time.monotonic()
        declared = dict(scope.get("headers", [])).get(b"content-length", b"0")
        too_big = declared.isdigit() and int(declared) > self.max_body_bytes
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if too_big or seen > self.max_body_bytes:
                    raise HTTPException(413, f"request body larger than {self.max_body_bytes} bytes")
            return message

        await self.app(scope, limited, send)

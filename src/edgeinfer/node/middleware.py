"""Pure ASGI middleware (it must not buffer streams): body size limit, JSON access log, outcome counts."""

from __future__ import annotations

import time
from typing import Any

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from edgeinfer.node.errors import is_workers_ai_path
from edgeinfer.node.run import STATUS_CLIENT_CLOSED
from edgeinfer.obs.access_log import log_access
from edgeinfer.obs.metrics import NodeMetrics

_INFERENCE_PATHS = ("/v1/completions", "/v1/chat/completions")


class NodeMiddleware:
    """Gives every request an `access` dict in its state (routes add fields to it), enforces the body
    limit while the body is read, and when the response is over (or the client left) writes one JSON
    access-log line and counts the outcome of inference requests by model and status."""

    def __init__(self, app: ASGIApp, metrics: NodeMetrics, max_body_bytes: int) -> None:
        self.app = app
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        access: dict[str, Any] = {}
        scope.setdefault("state", {})["access"] = access
        status: list[int] = []

        async def send_wrapper(message: Message) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        try:
            await self.app(scope, self._limited(scope, receive), send_wrapper)
        finally:
            self._finish(scope, access, status, started)

    def _limited(self, scope: Scope, receive: Receive) -> Receive:
        declared = _content_length(scope)
        raise_at_read = declared is not None and declared > self.max_body_bytes
        seen = 0

        async def receive_limited() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if raise_at_read or seen > self.max_body_bytes:
                    raise HTTPException(413, f"request body larger than {self.max_body_bytes} bytes")
            return message

        return receive_limited

    def _finish(self, scope: Scope, access: dict[str, Any], status: list[int], started: float) -> None:
        path = scope.get("path", "")
        # The route's own view wins: a stream that started with 200 but whose client left is a 499.
        final = access.get("status") or (status[0] if status else STATUS_CLIENT_CLOSED)
        if path in _INFERENCE_PATHS or is_workers_ai_path(path):
            self.metrics.count_outcome(access.get("model", "-"), final)
        client = scope.get("client")
        log_access(
            {
                "method": scope.get("method"),
                "path": path,
                "status": final,
                "duration_ms": round((time.monotonic() - started) * 1000, 3),
                "client": client[0] if client else None,
                **{k: v for k, v in access.items() if k != "status"},
            }
        )


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", []):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None

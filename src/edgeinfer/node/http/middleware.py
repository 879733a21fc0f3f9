"""Pure ASGI middleware (it must not buffer streams): request ids, body size and time limits, a generic
500 for unexpected errors, JSON access log, outcome counts."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from edgeinfer.api.errors import STATUS_CLIENT_CLOSED, is_workers_ai_path, unexpected
from edgeinfer.api.http.request_ids import request_id_of
from edgeinfer.finetunes.records import body_limit
from edgeinfer.obs.access_log import log_access
from edgeinfer.obs.metrics import NodeMetrics

logger = logging.getLogger("edgeinfer.node")

_INFERENCE_PATHS = ("/v1/completions", "/v1/chat/completions")


class NodeMiddleware:
    """Gives every request an id (`x-request-id` on every response) and an `access` dict in its state
    (holding the id as `request_id`; routes add fields to it), enforces the body's size and deadline while
    it is read, answers unexpected exceptions with a generic 500, and when the response is over (or the
    client left) writes one JSON access-log line and counts the outcome of inference requests."""

    def __init__(
        self, app: ASGIApp, metrics: NodeMetrics, max_body_bytes: int, body_timeout_s: float
    ) -> None:
        self.app = app
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        request_id = request_id_of(scope)
        access: dict[str, Any] = {"request_id": request_id}
        scope.setdefault("state", {})["access"] = access
        status: list[int] = []

        async def send_wrapper(message: Message) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", request_id.encode())]}
            await send(message)

        try:
            await self.app(scope, self._limited(scope, receive, started), send_wrapper)
        except Exception:
            logger.exception("unhandled error on %s (request id %s)", scope.get("path"), request_id)
            if not status:  # once a response started, the server can only close the connection
                await unexpected(request_id).response(scope.get("path", ""))(scope, receive, send_wrapper)
        finally:
            self._finish(scope, access, status, started)

    def _limited(self, scope: Scope, receive: Receive, started: float) -> Receive:
        declared = _content_length(scope)
        limit = body_limit(scope.get("path", ""), self.max_body_bytes)
        raise_at_read = declared is not None and declared > limit
        deadline = started + self.body_timeout_s
        seen = 0
        more_body = True

        async def receive_limited() -> Message:
            nonlocal seen, more_body
            if not more_body:  # the body is in; what follows is the wait for a disconnect
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                raise HTTPException(
                    408, f"request body not received within {self.body_timeout_s:g} s"
                ) from None
            if message["type"] == "http.request":
                more_body = message.get("more_body", False)
                seen += len(message.get("body", b""))
                if raise_at_read or seen > limit:
                    raise HTTPException(413, f"request body larger than {limit} bytes")
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

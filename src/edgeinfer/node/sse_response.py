"""A streaming response that always closes its body generator, even when the client disconnects."""

from __future__ import annotations

from collections.abc import AsyncGenerator

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send


class SSEResponse(StreamingResponse):
    """`text/event-stream` with no proxy buffering.

    Starlette cancels the sender when the client goes away, which can leave the body generator
    suspended at a `yield`; closing it here runs its cleanup (abort the generation, free the lease,
    meter the tokens) at once instead of whenever the garbage collector gets to it.
    """

    media_type = "text/event-stream"

    def __init__(self, content: AsyncGenerator[bytes, None], headers: dict[str, str]) -> None:
        super().__init__(content, headers={"cache-control": "no-cache", "x-accel-buffering": "no", **headers})
        self._generator = content

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._generator.aclose()

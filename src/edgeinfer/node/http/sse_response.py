"""A streaming response that always closes its body generator, even when the client disconnects or
stops reading."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator

from starlette.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from edgeinfer.node.http.connections import ABORT_CONNECTION

logger = logging.getLogger("edgeinfer.node")


class _ReaderStalled(Exception):
    pass


class SSEResponse(StreamingResponse):
    """`text/event-stream` with no proxy buffering.

    Starlette cancels the sender when the client goes away, which can leave the body generator
    suspended at a `yield`; closing it here runs its cleanup (abort the generation, free the lease,
    meter the tokens) at once instead of whenever the garbage collector gets to it.

    A client that stays connected but stops reading fills the socket buffers, and then every write waits;
    a write that waits longer than `write_timeout_s` ends the stream the same way and drops the connection,
    so a stalled reader holds nothing for longer than that.
    """

    media_type = "text/event-stream"

    def __init__(
        self, content: AsyncGenerator[bytes, None], headers: dict[str, str], write_timeout_s: float
    ) -> None:
        super().__init__(content, headers={"cache-control": "no-cache", "x-accel-buffering": "no", **headers})
        self._generator = content
        self._write_timeout_s = write_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def send_in_time(message: Message) -> None:
            # asyncio.timeout, not wait_for: wait_for runs every chunk's write in a task of its own, a
            # task and a timer per token on the event loop; this only arms a timer on the current task.
            try:
                async with asyncio.timeout(self._write_timeout_s):
                    await send(message)
            except TimeoutError:
                raise _ReaderStalled() from None

        try:
            await super().__call__(scope, receive, send_in_time)
        except _ReaderStalled:
            logger.warning("stream aborted: its reader took nothing for %g s", self._write_timeout_s)
            abort = scope.get("extensions", {}).get(ABORT_CONNECTION)
            if abort is not None:
                abort()
        finally:
            await self._generator.aclose()

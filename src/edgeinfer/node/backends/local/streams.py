"""Fanning a job's choices out to the engine and merging what comes back, in arrival order."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Sequence
from typing import Any

from edgeinfer.api.errors import ApiError, bad_request, internal
from edgeinfer.node.backends.local.choice import Choice
from edgeinfer.types import RequestOutput

logger = logging.getLogger("edgeinfer.node")


async def engine_outputs(
    engine: Any, choices: Sequence[Choice]
) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """Every choice's engine outputs as (choice index, output), in arrival order, until all finish.

    One choice (the common case) reads its engine stream directly: a pump task and a merge queue
    would add two task switches to every token's path through the event loop."""
    if len(choices) == 1:
        try:
            generation = engine.generate(choices[0].request, choices[0].take_usage)
            async with contextlib.aclosing(generation) as stream:
                async for output in stream:
                    yield 0, output
        except Exception as exc:
            raise as_api_error(exc) from None
        return
    merged: asyncio.Queue[tuple[int, RequestOutput | BaseException]] = asyncio.Queue()
    pumps = [asyncio.create_task(_pump(engine, i, c, merged)) for i, c in enumerate(choices)]
    remaining = len(choices)
    try:
        while remaining:
            index, item = await merged.get()
            if isinstance(item, BaseException):
                raise as_api_error(item)
            remaining -= item.finished
            yield index, item
    finally:
        for task in pumps:
            task.cancel()
        # each pump's stream learns the engine's final count as it closes: waited for, so it is billed
        await asyncio.gather(*pumps, return_exceptions=True)


async def _pump(engine: Any, index: int, choice: Choice, merged: asyncio.Queue[Any]) -> None:
    # The engine never waits on us: it fills the generator's own queue, and this task moves
    # deltas into an unbounded merge queue (bounded in practice by max_tokens).
    try:
        async for output in engine.generate(choice.request, choice.take_usage):
            merged.put_nowait((index, output))
    except Exception as exc:
        merged.put_nowait((index, exc))


def as_api_error(exc: BaseException) -> ApiError:
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, ValueError):  # EngineInputError: the request itself is unservable
        return bad_request(str(exc))
    logger.error("engine failure", exc_info=exc)
    return internal("internal error in the engine; the server log has the details")

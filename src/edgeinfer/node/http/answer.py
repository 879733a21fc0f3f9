"""A job's answer to the client: one JSON body, or a stream of server-sent events; either way the run is
finished (lease, admission, metering) exactly once, with the status the client got."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator

from fastapi.responses import JSONResponse, Response
from starlette.requests import Request

from edgeinfer.api.errors import STATUS_CLIENT_CLOSED, ApiError, unexpected
from edgeinfer.api.http.disconnect import ClientDisconnected, until_disconnect
from edgeinfer.node.backends.base import Backend, ChoiceDelta
from edgeinfer.node.http.render import DONE, Collected, Renderer, sse
from edgeinfer.node.http.sse_response import SSEResponse
from edgeinfer.node.run import RequestRun

logger = logging.getLogger("edgeinfer.node")


async def respond(
    request: Request, run: RequestRun, backend: Backend, renderer: Renderer, headers: dict[str, str]
) -> Response:
    """The whole answer as one JSON body, once the job is done."""
    collected = Collected()
    status = 500
    run.start()
    try:
        await until_disconnect(request, _collect(backend.run(run.job, run.outcome), collected))
        status = 200
    except ApiError as exc:
        status = exc.status
        raise
    except ClientDisconnected:
        status = STATUS_CLIENT_CLOSED
        return Response(status_code=STATUS_CLIENT_CLOSED)
    finally:
        run.finish(status)
    headers["x-edgeinfer-timing"] = run.outcome.latency.header_value()
    return JSONResponse(renderer.response(collected, run.outcome.usage), headers=headers)


async def collect(run: RequestRun, backend: Backend) -> Collected:
    """The whole answer of a run nobody waits on over HTTP (a queued entry); the run is finished with the
    status it ends with (499 when cancelled: the server is stopping and the entry goes back to the queue)."""
    collected = Collected()
    status = 500
    run.start()
    try:
        await _collect(backend.run(run.job, run.outcome), collected)
        status = 200
    except ApiError as exc:
        status = exc.status
        raise
    except asyncio.CancelledError:
        status = STATUS_CLIENT_CLOSED
        raise
    finally:
        run.finish(status)
    return collected


async def stream(
    request: Request,
    run: RequestRun,
    backend: Backend,
    renderer: Renderer,
    headers: dict[str, str],
    write_timeout_s: float,
) -> Response:
    """Server-sent events, from the job's first delta on."""
    deltas = backend.run(run.job, run.outcome)
    run.start()
    # Wait for the first delta before answering, so errors found by the engine on admission
    # (context too long, ...) still get a proper HTTP status instead of an event mid-stream.
    try:
        first = await until_disconnect(request, _first(deltas))
    except BaseException as exc:
        await deltas.aclose()
        run.finish(_status_of(exc))
        if isinstance(exc, ClientDisconnected):
            return Response(status_code=STATUS_CLIENT_CLOSED)
        raise
    return SSEResponse(_events(run, renderer, first, deltas), headers, write_timeout_s)


def _status_of(exc: BaseException) -> int:
    if isinstance(exc, ApiError):
        return exc.status
    if isinstance(exc, ClientDisconnected | asyncio.CancelledError):
        return STATUS_CLIENT_CLOSED
    return 500


async def _collect(deltas: AsyncIterator[ChoiceDelta], collected: Collected) -> None:
    async for delta in deltas:
        collected.add(delta)


async def _first(deltas: AsyncGenerator[ChoiceDelta, None]) -> ChoiceDelta | None:
    return await anext(deltas, None)


async def _events(
    run: RequestRun, renderer: Renderer, first: ChoiceDelta | None, deltas: AsyncGenerator[ChoiceDelta, None]
) -> AsyncGenerator[bytes, None]:
    """The SSE body. Until it completes the status is 499: a closed connection ends it via cancellation."""
    status = STATUS_CLIENT_CLOSED
    try:
        if first is not None:
            yield sse(renderer.chunk(first))
        async for delta in deltas:
            yield sse(renderer.chunk(delta))
        for chunk in renderer.final_chunks(run.outcome.usage):
            yield sse(chunk)
        yield DONE
        status = 200
    except ApiError as exc:
        status = exc.status
        yield sse(renderer.error_event(exc))
        yield DONE
    except Exception:
        logger.exception("stream %s failed", run.job.request_id)
        status = 500
        yield sse(renderer.error_event(unexpected(run.access["request_id"])))
        yield DONE
    finally:
        try:
            await deltas.aclose()
        finally:
            run.finish(status)

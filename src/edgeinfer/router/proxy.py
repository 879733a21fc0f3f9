"""Forwarding one request to the ranked nodes: retries before the first byte, never after.

A node's answer is committed to the client when its response headers arrive with a status other than
429 or 5xx (a node streams its headers only once the first token exists, so errors found on admission
still come as a status). Until then, a connection failure, timeout, 5xx or 429 moves on to the next
candidate; after it, a failure aborts the client's connection — a half-sent answer is never repeated.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

import httpx
from fastapi.responses import Response
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from edgeinfer.api.errors import STATUS_CLIENT_CLOSED, ApiError, unavailable
from edgeinfer.api.http.disconnect import ClientDisconnected, until_disconnect
from edgeinfer.router.config import RouterConfig
from edgeinfer.router.metrics import RouterMetrics
from edgeinfer.router.policy import Candidate
from edgeinfer.router.state import FleetState, NodeView

logger = logging.getLogger("edgeinfer.router")

# Not forwarded either way: connection-level headers, the body length (the body is re-framed) and
# what our own server sets again.
HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "host",
    "content-length",
    "date",
    "server",
}


@dataclass(kw_only=True)
class Forward:
    """One request to forward: the body as the client sent it and the headers the node gets."""

    path: str
    body: bytes
    headers: dict[str, str]
    client_location: str
    started: float
    emulated_s: float = 0.0  # time slept by --emulate-rtt, left out of the added latency


class NodeAnswer(Exception):
    """A retryable answer (429, 5xx) that is what the client gets if every candidate fails alike."""

    def __init__(self, status: int, body: bytes, headers: dict[str, str]) -> None:
        self.status, self.body, self.headers = status, body, headers


class Forwarder:
    def __init__(
        self,
        config: RouterConfig,
        state: FleetState,
        clients: Sequence[httpx.AsyncClient],
        metrics: RouterMetrics,
    ) -> None:
        self.config = config
        self.state = state
        self._clients = itertools.cycle(clients)  # one pool per attempt, in turn (app.POOL_SHARDS)
        self.metrics = metrics

    async def forward(self, request: Request, job: Forward, ranked: Sequence[Candidate]) -> Response:
        last: NodeAnswer | None = None
        tried = 0
        for candidate in ranked:
            if tried >= self.config.max_attempts:
                break
            view = self.state.nodes[candidate.node_id]
            if not view.breaker.acquire():
                continue
            if tried:
                self.metrics.retries.inc()
            tried += 1
            try:
                return await until_disconnect(request, self._counted_attempt(view, job))
            except ClientDisconnected:
                view.breaker.release()
                self.metrics.count(view.entry, "client_closed")
                return Response(status_code=STATUS_CLIENT_CLOSED)
            except NodeAnswer as answer:
                last = answer
            except TimeoutError:
                view.breaker.failure()
                self.metrics.count(view.entry, "timeout")
                raise ApiError(
                    504, "no node answered before the deadline", type="timeout", code="timeout"
                ) from None
            except httpx.HTTPError as exc:
                view.breaker.failure()
                self.metrics.count(view.entry, "unreachable")
                logger.warning("node %s failed before the first byte: %r", view.entry.node_id, exc)
        if last is not None:
            return Response(last.body, status_code=last.status, headers=last.headers)
        raise unavailable("no node could take the request; retry shortly", retry_after=1.0)

    async def _counted_attempt(self, view: NodeView, job: Forward) -> Response:
        """`_attempt`, counted in the node's view (state.py) until its answer is relayed or it fails."""
        counted = view.sent()
        try:
            return await self._attempt(view, job, lambda: view.finished(counted))
        except BaseException:  # no answer to relay (cancelled by a disconnect too): the request is over
            view.finished(counted)
            raise

    async def _attempt(self, view: NodeView, job: Forward, on_end: Callable[[], None]) -> Response:
        entry = view.entry
        await self._emulate_one_way(job, job.client_location, entry.location)
        remaining = job.started + self.config.first_byte_timeout_s - time.monotonic()
        client = next(self._clients)
        # Latin-1 both ways, as the ASGI server decodes and encodes them: header bytes pass as they came
        # (httpx's default, ASCII, fails on any other byte a client sent).
        headers = httpx.Headers(job.headers, encoding="latin-1")
        request = client.build_request("POST", entry.url + job.path, content=job.body, headers=headers)
        sent = time.monotonic()
        async with asyncio.timeout(max(0.0, remaining)):
            response = await client.send(request, stream=True)
        node_s = time.monotonic() - sent
        headers = _relayed_headers(response)
        if response.status_code == 429 or response.status_code >= 500:
            body = await response.aread()
            await response.aclose()
            if response.status_code >= 500:
                view.breaker.failure()
            else:
                view.breaker.success()
            self.metrics.count(entry, str(response.status_code))
            raise NodeAnswer(response.status_code, body, headers)
        view.breaker.success()
        await self._emulate_one_way(job, entry.location, job.client_location)
        self.metrics.count(entry, str(response.status_code))
        self.metrics.first_byte.observe(time.monotonic() - job.started)
        headers.update({"x-edgeinfer-node": entry.node_id, "x-edgeinfer-location": entry.location})

        def headers_sent() -> None:
            self.metrics.added.observe(time.monotonic() - job.started - node_s - job.emulated_s)

        return RelayResponse(response, view, headers, headers_sent, on_end)

    async def _emulate_one_way(self, job: Forward, a: str, b: str) -> None:
        if self.config.emulate_rtt:
            delay = self.state.fleet.rtt(a, b) / 2
            await asyncio.sleep(delay)
            job.emulated_s += delay


def _relayed_headers(response: httpx.Response) -> dict[str, str]:
    """The node's headers for the client (repeated ones joined, as httpx joins them), decoded as Latin-1,
    which Starlette encodes them with again, so that their bytes pass unchanged; httpx's own decoding may
    read them as UTF-8, which Latin-1 then cannot encode."""
    headers: dict[str, str] = {}
    for raw_name, raw_value in response.headers.raw:
        name, value = raw_name.decode("latin-1").lower(), raw_value.decode("latin-1")
        if name not in HOP_BY_HOP:
            headers[name] = f"{headers[name]}, {value}" if name in headers else value
    return headers


class RelayResponse(StreamingResponse):
    """Passes the node's body through chunk by chunk; closes the node's response however it ends
    (closing it mid-stream drops that connection, which is how the node learns the client left).
    `on_start` runs when the response headers go to the client, `on_end` when the relay ends."""

    def __init__(
        self,
        upstream: httpx.Response,
        view: NodeView,
        headers: dict[str, str],
        on_start: Callable[[], None],
        on_end: Callable[[], None],
    ) -> None:
        super().__init__(_chunks(upstream, view), status_code=upstream.status_code, headers=headers)
        self._upstream = upstream
        self._on_start = on_start
        self._on_end = on_end

    def also_on_end(self, callback: Callable[[], None]) -> None:
        """Run `callback` too when the relay ends (after what runs already)."""
        first = self._on_end

        def both() -> None:
            try:
                first()
            finally:
                callback()

        self._on_end = both

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def watched(message: Message) -> None:
            await send(message)
            if message["type"] == "http.response.start":
                self._on_start()

        try:
            await super().__call__(scope, receive, watched)
        finally:
            self._on_end()
            with contextlib.suppress(Exception):
                await self._upstream.aclose()


async def _chunks(upstream: httpx.Response, view: NodeView) -> AsyncIterator[bytes]:
    try:
        async for chunk in upstream.aiter_raw():
            yield chunk
    except httpx.HTTPError:
        # The node went away mid-answer: the client's connection is aborted, never resumed elsewhere.
        view.breaker.failure()
        logger.warning(
            "node %s failed after the first byte; aborting the client's answer", view.entry.node_id
        )
        raise

"""Forwarding one request to the ranked nodes: retries before the first byte, never after.

A node's answer is committed to the client when its response headers arrive with a status other than
429 or 5xx (a node streams its headers only once the first token exists, so errors found on admission
still come as a status). Until then, a connection failure, timeout, 5xx or 429 moves on to the next
candidate; after it, a failure aborts the client's connection — a half-sent answer is never repeated.
The body is relayed as it arrives, from the node connection's parser callbacks to the client's socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from edgeinfer.api.errors import ApiError, unavailable
from edgeinfer.router.config import RouterConfig
from edgeinfer.router.http_server import ClientConnection
from edgeinfer.router.metrics import RouterMetrics
from edgeinfer.router.policy import Candidate
from edgeinfer.router.state import FleetState, NodeView
from edgeinfer.router.upstream import NodeConnection, NodePool, UpstreamError
from edgeinfer.router.wire import Reply, Request, head

logger = logging.getLogger("edgeinfer.router")

# Not forwarded either way: connection-level headers, the body's framing (the router frames it again),
# what the router sets itself, and the request id (each side gets the router's).
HOP_BY_HOP = {
    b"connection",
    b"keep-alive",
    b"proxy-authenticate",
    b"proxy-authorization",
    b"te",
    b"trailer",
    b"transfer-encoding",
    b"upgrade",
    b"host",
    b"content-length",
    b"date",
    b"server",
    b"x-request-id",
}


@dataclass(kw_only=True)
class Forward:
    """One request to forward: the body as the client sent it and the header lines the node gets."""

    target: bytes
    body: bytes
    header_lines: bytes  # "name: value\r\n" each, request id and signed tenant included
    client_location: str
    started: float
    emulated_s: float = 0.0  # time slept by --emulate-rtt, left out of the added latency

    def wire(self, host: bytes) -> bytes:
        return (
            b"POST %s HTTP/1.1\r\nhost: %s\r\n%scontent-length: %d\r\n\r\n"
            % (self.target, host, self.header_lines, len(self.body))
            + self.body
        )


class NodeAnswer(Exception):
    """A retryable answer (429, 5xx) that is what the client gets if every candidate fails alike."""

    def __init__(self, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
        self.status, self.body, self.headers = status, body, headers


class Forwarder:
    """The node pools, and the requests' ways through them (`begin`)."""

    def __init__(self, config: RouterConfig, state: FleetState, metrics: RouterMetrics) -> None:
        self.config = config
        self.state = state
        self.metrics = metrics
        self.pools = {
            node_id: NodePool(view.entry.url, config.connect_timeout_s, config.idle_timeout_s)
            for node_id, view in state.nodes.items()
        }

    def close(self) -> None:
        for pool in self.pools.values():
            pool.close()

    def begin(
        self, job: Forward, ranked: Sequence[Candidate], on_relay: Callable[[Relay], None] | None = None
    ) -> Forwarding:
        """`job` on its way to the first of `ranked` that takes it, now; `Forwarding.answer` awaits the
        rest. `on_relay`: called with the answer that is relayed, when it is."""
        return Forwarding(self, job, ranked, on_relay)

    def views(self, ranked: Sequence[Candidate]) -> Iterator[NodeView]:
        """The nodes to try in turn: at most `max_attempts`, each holding a slot of its breaker."""
        tried = 0
        for candidate in ranked:
            if tried >= self.config.max_attempts:
                return
            view = self.state.nodes[candidate.node_id]
            if not view.breaker.acquire():
                continue
            if tried:
                self.metrics.retries.inc()
            tried += 1
            yield view


@dataclass(slots=True)
class Attempt:
    """The request to one node, counted in the node's view (state.py) until its answer is relayed or it
    fails. `node`: the connection it went out on already, where it could go at once."""

    view: NodeView
    pool: NodePool
    data: bytes
    counted: int
    node: NodeConnection | None
    sent: float


class Forwarding:
    """One request through its candidates. The first attempt goes out when this is made where that needs
    no waiting (an idle pooled connection, no emulated RTT), so a request reaches its node in the event
    loop's turn that read it; the rest (the answer's head, retries, the relay) is `answer`'s."""

    __slots__ = ("_attempt", "_config", "_forwarder", "_job", "_metrics", "_on_relay", "_views")

    def __init__(
        self,
        forwarder: Forwarder,
        job: Forward,
        ranked: Sequence[Candidate],
        on_relay: Callable[[Relay], None] | None,
    ) -> None:
        self._forwarder = forwarder
        self._config = forwarder.config
        self._metrics = forwarder.metrics
        self._job = job
        self._on_relay = on_relay
        self._views = forwarder.views(ranked)
        self._attempt = self._next()

    def _next(self) -> Attempt | None:
        view = next(self._views, None)
        if view is None:
            return None
        job = self._job
        pool = self._forwarder.pools[view.entry.node_id]
        data = job.wire(pool.host_header)
        counted = view.sent()
        sent = time.monotonic()
        node = None if self._config.emulate_rtt else pool.send_idle(data, self._remaining(sent))
        return Attempt(view, pool, data, counted, node, sent)

    def _remaining(self, now: float) -> float:
        return max(0.0, self._job.started + self._config.first_byte_timeout_s - now)

    async def answer(self) -> Reply | Relay:
        last: NodeAnswer | None = None
        while (attempt := self._attempt) is not None:
            view = attempt.view
            try:
                relay = await self._counted(attempt)
            except asyncio.CancelledError:  # the client went away (its connection cancels its task)
                self._client_left(attempt)
                raise
            except NodeAnswer as answer:
                last = answer
            except TimeoutError:
                view.breaker.failure()
                self._metrics.count(view.entry, "timeout")
                raise ApiError(
                    504, "no node answered before the deadline", type="timeout", code="timeout"
                ) from None
            except OSError as exc:  # UpstreamError and the socket's own errors
                view.breaker.failure()
                self._metrics.count(view.entry, "unreachable")
                logger.warning("node %s failed before the first byte: %r", view.entry.node_id, exc)
            else:
                if self._on_relay is not None:
                    self._on_relay(relay)
                return relay
            self._attempt = self._next()
        if last is not None:
            return Reply(last.status, last.body, last.headers, content_type=None)
        raise unavailable("no node could take the request; retry shortly", retry_after=1.0)

    def abandon(self) -> None:
        """The client left before `answer` was awaited: the node's connection drops (how it learns), and
        nothing counts against the node."""
        attempt = self._attempt
        if attempt is not None:
            self._client_left(attempt)
            attempt.view.finished(attempt.counted)

    def _client_left(self, attempt: Attempt) -> None:
        if attempt.node is not None:
            attempt.node.abort()
        attempt.view.breaker.release()
        self._metrics.count(attempt.view.entry, "client_closed")

    async def _counted(self, attempt: Attempt) -> Relay:
        """`_relay`, counted in the node's view until its answer is relayed or it fails."""
        try:
            return await self._relay(attempt, lambda: attempt.view.finished(attempt.counted))
        except BaseException:  # no answer to relay (cancelled by a disconnect too): the request is over
            attempt.view.finished(attempt.counted)
            raise

    async def _relay(self, attempt: Attempt, on_end: Callable[[], None]) -> Relay:
        view, job = attempt.view, self._job
        entry = view.entry
        node: NodeConnection | None = None
        try:
            if attempt.node is None and self._config.emulate_rtt:
                await self._emulate_one_way(job.client_location, entry.location)
                attempt.sent = time.monotonic()
            node = await attempt.pool.exchange(attempt.data, self._remaining(attempt.sent), attempt.node)
            attempt.node = None  # from here on this function's to drop
            node_s = time.monotonic() - attempt.sent
            if node.status == 429 or node.status >= 500:
                self._refused(view, node.status)
                body = await node.body()
                attempt.pool.release(node)
                raise NodeAnswer(node.status, body, _relayed_headers(node.headers))
            view.breaker.success()
            await self._emulate_one_way(entry.location, job.client_location)
        except (NodeAnswer, UpstreamError):
            raise
        except BaseException:
            if node is not None:
                node.abort()
            raise
        self._metrics.count(entry, str(node.status))
        self._metrics.first_byte.observe(time.monotonic() - job.started)
        headers = _relayed_headers(node.headers)
        headers += [
            (b"x-edgeinfer-node", entry.node_id.encode()),
            (b"x-edgeinfer-location", entry.location.encode()),
        ]

        def headers_sent() -> None:
            self._metrics.added.observe(time.monotonic() - job.started - node_s - job.emulated_s)

        return Relay(node, view, headers, headers_sent, on_end)

    def _refused(self, view: NodeView, status: int) -> None:
        if status >= 500:
            view.breaker.failure()
        else:
            view.breaker.success()
        self._metrics.count(view.entry, str(status))

    async def _emulate_one_way(self, a: str, b: str) -> None:
        if self._config.emulate_rtt:
            delay = self._forwarder.state.fleet.rtt(a, b) / 2
            await asyncio.sleep(delay)
            self._job.emulated_s += delay


def _relayed_headers(raw: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The node's headers for the client, bytes as they came, less what is connection-level."""
    return [(name, value) for name, value in raw if name not in HOP_BY_HOP]


class Relay:
    """Passes the node's body to the client chunk by chunk, from the node connection's parser callbacks:
    with its Content-Length where the node sent one, else chunked. The node's connection goes back to its
    pool when the answer is complete, and is dropped when the relay ends otherwise (which is how the node
    learns that the client left). `on_start` runs when the response head goes to the client, `on_end` when
    the relay ends."""

    def __init__(
        self,
        node: NodeConnection,
        view: NodeView,
        headers: list[tuple[bytes, bytes]],
        on_start: Callable[[], None],
        on_end: Callable[[], None],
    ) -> None:
        self.status = node.status
        self._node = node
        self._view = view
        self._headers = headers
        self._on_start = on_start
        self._on_end = on_end
        self._client: ClientConnection | None = None
        self._chunked = True
        self._done: asyncio.Future[bool] | None = None
        self._out: list[bytes] = []  # for the client, written at the next flush

    @property
    def node_id(self) -> str:
        return self._view.entry.node_id

    def also_on_end(self, callback: Callable[[], None]) -> None:
        """Run `callback` too when the relay ends (after what runs already)."""
        first = self._on_end

        def both() -> None:
            try:
                first()
            finally:
                callback()

        self._on_end = both

    async def send(self, client: ClientConnection, request: Request, keep_alive: bool) -> bool:
        """Relay the answer; whether the client's connection stays open after it."""
        length = next((v for k, v in self._node.headers if k == b"content-length"), None)
        self._chunked = length is None and not request.http_10
        if length is not None:
            framing = b"content-length: %s\r\n" % length
        else:
            framing = b"transfer-encoding: chunked\r\n" if self._chunked else b""
            keep_alive = keep_alive and self._chunked  # unframed: the body ends with the connection
        headers = [*self._headers, (b"x-request-id", request.request_id.encode())]
        self._client = client
        self._done = self._node.loop.create_future()
        ok = False
        try:
            self._out.append(head(self.status, headers, framing, keep_alive))  # with the body that came
            self._on_start()
            client.flow = self
            self._node.attach(self)
            ok = await self._done
        finally:
            client.flow = None
            try:
                self._on_end()
            finally:
                if ok:
                    self._node.pool.release(self._node)
                else:
                    self._node.abort()
        if not ok:
            client.abort()
        return keep_alive

    # --- the node connection's sink ---------------------------------------------------------------

    def chunk(self, data: bytes) -> None:
        self._out.append(b"%x\r\n%s\r\n" % (len(data), data) if self._chunked else data)

    def flush(self) -> None:
        assert self._client is not None
        if self._out:
            self._client.write(self._out[0] if len(self._out) == 1 else b"".join(self._out))
            self._out.clear()

    def end(self) -> None:
        assert self._client is not None and self._done is not None
        if self._chunked:
            self._out.append(b"0\r\n\r\n")
        if not self._done.done():
            self._done.set_result(True)

    def broken(self) -> None:
        """The node went away mid-answer: the client's connection is aborted, never resumed elsewhere."""
        assert self._done is not None
        self._view.breaker.failure()
        logger.warning(
            "node %s failed after the first byte; aborting the client's answer", self._view.entry.node_id
        )
        if not self._done.done():
            self._done.set_result(False)

    # --- flow control: the client's socket buffer is full ---------------------------------------

    def pause(self) -> None:
        self._node.pause()

    def resume(self) -> None:
        with contextlib.suppress(Exception):
            self._node.resume()

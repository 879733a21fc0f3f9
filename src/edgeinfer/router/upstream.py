"""The node side of the data plane: pooled keep-alive HTTP/1.1 connections to each node, parsed by
httptools. A connection carries one request at a time; its answer's head resolves a future, and its body
goes straight from the parser's callbacks to a sink (the relay to the client, proxy.py), buffered only
until the sink is attached."""

from __future__ import annotations

import asyncio
import socket
import urllib.parse
from typing import Protocol

import httptools

MAX_IDLE_PER_NODE = 512  # kept-alive connections to one node; more in flight close when they end


class UpstreamError(ConnectionError):
    """The node's connection failed or closed before its answer's head arrived (retryable elsewhere)."""


class Sink(Protocol):
    def chunk(self, data: bytes) -> None: ...

    def flush(self) -> None:
        """Write what `chunk` and `end` gave since the last flush: one write per read from the node."""

    def end(self) -> None: ...

    def broken(self) -> None: ...


class NodeConnection(asyncio.Protocol):
    def __init__(self, pool: NodePool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.lost = False
        self._parser = httptools.HttpResponseParser(self)
        self._timer: asyncio.TimerHandle | None = None
        self.loop = asyncio.get_running_loop()
        self._reset()

    def _reset(self) -> None:
        self.head: asyncio.Future[None] | None = None
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.complete = False
        self.keep_alive = False
        self.got_bytes = False
        self._buffered: list[bytes] = []
        self._sink: Sink | None = None
        self._finished: asyncio.Future[bytes] | None = None
        self._last = 0.0
        self._deadline = 0.0
        self._expired: TimeoutError | None = None

    # --- one exchange -------------------------------------------------------------------------------

    def send(self, data: bytes, timeout_s: float) -> asyncio.Future[None]:
        """Send a whole request; the future resolves when the answer's head has arrived. The head, and a
        body read whole (`body`), must come within `timeout_s`, else TimeoutError and the connection drops."""
        assert self.transport is not None
        self._reset()
        self.head = self.loop.create_future()
        self._last = self.loop.time()
        self._deadline = self._last + timeout_s
        # One timer per exchange serves both bounds (an asyncio.timeout per request costs more than the
        # rest of the exchange's Python): it fires at the nearer one and re-arms while there is time left.
        wake = min(self._deadline, self._last + self.pool.idle_timeout_s)
        self._timer = self.loop.call_at(wake, self._check)
        self.transport.write(data)
        return self.head

    async def body(self) -> bytes:
        """The whole body of an answer that is not relayed (a retryable 429 or 5xx)."""
        if not self.complete:
            if self.lost:  # before this was awaited: its deadline, or the node's close
                raise self._expired or UpstreamError("node connection closed inside an answer")
            self._finished = self.loop.create_future()
            await self._finished
        return b"".join(self._buffered)

    def attach(self, sink: Sink) -> None:
        """From now on the body goes to `sink`, what arrived so far first."""
        buffered, self._buffered = self._buffered, []
        for data in buffered:
            sink.chunk(data)
        if self.complete:
            sink.end()
        elif self.lost:
            sink.broken()
        else:
            self._sink = sink
        sink.flush()

    def pause(self) -> None:
        if self.transport is not None:
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.transport is not None:
            self.transport.resume_reading()

    def abort(self) -> None:
        """Drop the connection mid-exchange, by the router's choice (its client left, the answer is not
        wanted): how a node learns that its client left. The sink hears nothing: no failure of the node."""
        self._sink = None
        if self.head is not None:
            self.head.cancel()  # its answer is not wanted: nothing awaits it, nothing is to report
        self._drop()

    def _drop(self) -> None:
        """Drop the connection for the node's fault (silence, bad framing): an attached sink is told."""
        self._stop_timer()
        if self.transport is not None:
            self.transport.abort()

    def _check(self) -> None:
        """The exchange's timer: the deadline while the answer is not relayed, and the idle bound."""
        now = self.loop.time()
        waiting = self._sink is None and not self.complete  # for the head, or a body read whole
        if waiting and now >= self._deadline:
            self._timer = None
            self._expire()
            return
        if now - self._last >= self.pool.idle_timeout_s:
            self._timer = None
            self._drop()
            return
        wake = self._last + self.pool.idle_timeout_s
        self._timer = self.loop.call_at(min(wake, self._deadline) if waiting else wake, self._check)

    def _expire(self) -> None:
        self._expired = TimeoutError("the node did not answer before the deadline")
        for future in (self.head, self._finished):
            if future is not None and not future.done():
                future.set_exception(self._expired)
                break
        self._drop()

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    # --- asyncio.Protocol ---------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        self._last = self.loop.time()
        sink = self._sink
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError:
            self._drop()
        if sink is not None:
            sink.flush()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self._stop_timer()
        self.pool.forget(self)
        if self.head is not None and not self.head.done():
            self.head.set_exception(UpstreamError(f"node connection closed before its answer ({exc!r})"))
        elif self._finished is not None and not self._finished.done():
            self._finished.set_exception(UpstreamError("node connection closed inside an answer"))
        elif self._sink is not None and not self.complete:
            self._sink.broken()

    # --- httptools callbacks ------------------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()
        if self.status < 200:  # an interim answer (100 Continue): the real one follows
            self.headers = []
        elif self.head is not None and not self.head.done():
            self.head.set_result(None)

    def on_body(self, data: bytes) -> None:
        if self._sink is not None:
            self._sink.chunk(data)
        else:
            self._buffered.append(data)

    def on_message_complete(self) -> None:
        if self.status < 200:
            return
        self.complete = True
        self.keep_alive = self._parser.should_keep_alive()
        self._stop_timer()
        if self._sink is not None:
            self._sink.end()
        elif self._finished is not None and not self._finished.done():
            self._finished.set_result(b"")


class NodePool:
    """Keep-alive connections to one node, the most recently used first."""

    def __init__(self, url: str, connect_timeout_s: float, idle_timeout_s: float) -> None:
        parts = urllib.parse.urlsplit(url)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        self.host_header = parts.netloc.encode()
        self.connect_timeout_s = connect_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self._idle: dict[NodeConnection, None] = {}

    def send_idle(self, data: bytes, timeout_s: float) -> NodeConnection | None:
        """Send `data` on the most recently used kept-alive connection, at once, where one is there (for
        `exchange` to take over); None where a connection must be made first."""
        while self._idle:
            conn = self._idle.popitem()[0]
            if not conn.lost and conn.transport is not None and not conn.transport.is_closing():
                conn.send(data, timeout_s)
                return conn
        return None

    async def exchange(
        self, data: bytes, timeout_s: float, sent: NodeConnection | None = None
    ) -> NodeConnection:
        """Send `data` and wait for the answer's head; it (and a body read whole) must come within
        `timeout_s`, else TimeoutError. `sent`: the connection `send_idle` sent `data` on already. A
        kept-alive connection the node closed meanwhile is no failure of the node: the request goes again
        on a new connection."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        conn = sent if sent is not None else self.send_idle(data, timeout_s)
        if conn is not None:
            assert conn.head is not None
            try:
                await conn.head
                return conn
            except UpstreamError:
                if conn.got_bytes:
                    raise
            except BaseException:
                conn.abort()
                raise
        conn = await self._connect(loop, deadline)
        try:
            await conn.send(data, deadline - loop.time())
        except BaseException:
            conn.abort()
            raise
        return conn

    async def _connect(self, loop: asyncio.AbstractEventLoop, deadline: float) -> NodeConnection:
        connect_by = loop.time() + self.connect_timeout_s
        try:
            async with asyncio.timeout_at(min(connect_by, deadline)):
                _, conn = await loop.create_connection(lambda: NodeConnection(self), self.host, self.port)
        except TimeoutError:
            if deadline <= connect_by:
                raise  # the exchange's own deadline: no time left for this node
            raise UpstreamError(
                f"no connection to {self.host}:{self.port} within the connect timeout"
            ) from None
        return conn

    def release(self, conn: NodeConnection) -> None:
        """An exchange ended: keep the connection for the next one where the node keeps it too."""
        if conn.complete and conn.keep_alive and not conn.lost and len(self._idle) < MAX_IDLE_PER_NODE:
            conn.resume()  # a relay to a slow client may have paused it
            self._idle[conn] = None
        else:
            conn.abort()

    def forget(self, conn: NodeConnection) -> None:
        self._idle.pop(conn, None)

    def close(self) -> None:
        for conn in list(self._idle):
            conn.abort()
        self._idle.clear()

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
        self._loop = asyncio.get_running_loop()
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

    # --- one exchange -------------------------------------------------------------------------------

    def send(self, data: bytes) -> asyncio.Future[None]:
        """Send a whole request; the future resolves when the answer's head has arrived."""
        assert self.transport is not None
        self._reset()
        self.head = self._loop.create_future()
        self._last = self._loop.time()
        self._timer = self._loop.call_later(self.pool.idle_timeout_s, self._check_idle)
        self.transport.write(data)
        return self.head

    async def body(self) -> bytes:
        """The whole body of an answer that is not relayed (a retryable 429 or 5xx)."""
        if not self.complete:
            self._finished = self._loop.create_future()
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
        """Drop the connection mid-exchange: how a node learns that its client left."""
        self._stop_timer()
        if self.transport is not None:
            self.transport.abort()

    def _check_idle(self) -> None:
        idle = self._loop.time() - self._last
        if idle >= self.pool.idle_timeout_s:
            self._timer = None
            self.abort()
        else:
            self._timer = self._loop.call_later(self.pool.idle_timeout_s - idle, self._check_idle)

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
        self._last = self._loop.time()
        sink = self._sink
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError:
            self.abort()
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

    async def exchange(self, data: bytes) -> NodeConnection:
        """Send `data` and wait for the answer's head. A kept-alive connection the node closed meanwhile
        is no failure of the node: the request goes again on a new connection."""
        conn = self._idle.popitem()[0] if self._idle else None
        if (
            conn is not None
            and not conn.lost
            and conn.transport is not None
            and not conn.transport.is_closing()
        ):
            try:
                await conn.send(data)
                return conn
            except UpstreamError:
                if conn.got_bytes:
                    raise
            except BaseException:
                conn.abort()
                raise
        conn = await self._connect()
        try:
            await conn.send(data)
        except BaseException:
            conn.abort()
            raise
        return conn

    async def _connect(self) -> NodeConnection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(lambda: NodeConnection(self), self.host, self.port)
        except TimeoutError:
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

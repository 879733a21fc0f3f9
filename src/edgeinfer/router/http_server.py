"""The client side of the data plane: one asyncio protocol per connection, parsed by httptools, no framework.

Requests on a connection are answered in order (pipelined ones wait in a short queue, reading pauses
behind it). Every input gets an answer before the connection ends: a body over the limit is read and
dropped, then answered 413 on the same keep-alive connection; a body cut short by the client's half-close
is answered 400 before the close; a request the parser refuses is answered 400 and the connection closes,
because its framing is lost.

A request on an idle connection begins in the parser callback that completed it (`App.begin`): a
generation goes to its node in the event loop's turn that read it, not after the turn's other callbacks
(the relays of every other stream) as a new task's first step would. What must wait is the task's.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
import urllib.parse
from collections import deque
from typing import Protocol

import httptools

from edgeinfer.api.errors import ApiError, bad_request, body_too_large
from edgeinfer.api.http.parser_errors import PARSER_REJECTED
from edgeinfer.finetunes.records import body_limit
from edgeinfer.router.wire import Reply, Request, error_reply, reply_bytes, request_id

logger = logging.getLogger("edgeinfer.router")
MAX_PIPELINED = 4  # requests queued on one connection before it stops reading
# A connection silent this long between requests is closed; one silent this long inside a request gets a 408.
IDLE_S = 30.0
LINGER_S = 2.0  # reading on after the last answer of a connection the router closes


class StopParsing(Exception):
    """Raised in a parser callback to stop reading the connection (its answer is queued already)."""


class Streamed(Protocol):
    """An answer relayed from a node (proxy.Relay)."""

    async def send(self, conn: ClientConnection, request: Request, keep_alive: bool) -> bool: ...

    def pause(self) -> None: ...

    def resume(self) -> None: ...


class Pending(Protocol):
    """A request begun at its arrival, its answer still to come."""

    async def answer(self) -> Reply | Streamed: ...

    def abandon(self) -> None:
        """The client left before `answer` was awaited: let go of what was begun."""


class App(Protocol):
    max_body_bytes: int

    def begin(self, request: Request) -> Reply | Pending | None:
        """Begin answering `request` at once, without awaiting anything; None where all of it waits."""

    async def handle(self, request: Request, begun: Pending | None) -> Reply | Streamed: ...


class ClientConnection(asyncio.Protocol):
    def __init__(self, app: App, connections: set[ClientConnection]) -> None:
        self.app = app
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.flow: Streamed | None = None  # the relay that writes now; paused with the client's socket
        self._connections = connections
        self._parser = httptools.HttpRequestParser(self)
        # Header values as the node's parser takes them: any byte but NUL, CR and LF (on_header refuses
        # those); llhttp's strict mode also refuses DEL and other controls that clients do send.
        self._parser.set_dangerous_leniencies(lenient_headers=True)
        self._queue: deque[tuple[Request, Reply | Pending | None]] = deque()
        self._task: asyncio.Task[None] | None = None
        self._eof = False
        self._broken = False  # the parser refused the stream: nothing after it can be read
        self._partial: Request | None = None
        self._url: list[bytes] = []
        self._body: list[bytes] = []
        self._size = 0
        self._declared = -1
        self._too_big = False
        self._limit = app.max_body_bytes  # the request's own: an adapter upload may send more
        self._loop = asyncio.get_running_loop()
        self._last_data = self._loop.time()
        self._idle_timer: asyncio.TimerHandle | None = None

    @property
    def busy(self) -> bool:
        """Whether a request is being answered or waits to be."""
        return self._task is not None or bool(self._queue)

    # --- asyncio.Protocol ---------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:  # Nagle's algorithm would hold a stream's small chunks for the client's ACK
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._connections.add(self)
        self._idle_timer = self._loop.call_later(IDLE_S, self._check_idle)

    def data_received(self, data: bytes) -> None:
        self._last_data = self._loop.time()
        if self._broken:
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._upgrade()
        except httptools.HttpParserError:
            if not self._broken:  # else a callback stopped the parser, having answered already
                self._refuse(PARSER_REJECTED)

    def eof_received(self) -> bool:
        """The client half-closed: answer what it sent (a request cut short included), then close."""
        self._eof = True
        partial = self._partial
        if partial is not None and not self._broken:
            self._partial = None
            if partial.method:
                of = f"of {self._declared} " if self._declared >= 0 else ""
                error = self._limit_error() or bad_request(
                    f"request body truncated: the connection ended after {self._size} {of}bytes"
                )
                self._enqueue(partial, error_reply(error, partial.path))
            else:
                self._refuse("invalid HTTP request: the connection ended inside the request head")
        return self.busy  # True keeps the transport open for the answers still to write

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._connections.discard(self)
        if self._idle_timer is not None:
            self._idle_timer.cancel()
        if self._task is not None:
            self._task.cancel()  # the relay or attempt in flight ends, and the node hears of it
        # A task cancelled before its first step never runs: what was begun for it is let go here.
        for _, ready in self._queue:
            if ready is not None and not isinstance(ready, Reply):
                ready.abandon()
        self._queue.clear()

    def pause_writing(self) -> None:
        if self.flow is not None:
            self.flow.pause()

    def resume_writing(self) -> None:
        if self.flow is not None:
            self.flow.resume()

    # --- httptools callbacks ------------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._partial = Request(
            method=b"", target=b"/", path="/", query=b"", headers=[], body=b"",
            arrived=time.monotonic(), keep_alive=False,
        )  # fmt: skip
        self._url = []
        self._body = []
        self._size = 0
        self._declared = -1
        self._too_big = False
        self._limit = self.app.max_body_bytes

    def on_url(self, url: bytes) -> None:
        self._url.append(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        assert self._partial is not None
        if b"\x00" in value or b"\r" in value or b"\n" in value:
            raise ValueError("a NUL, CR or LF in a header value")  # the parser's error: a 400, then close
        self._partial.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        request = self._partial
        assert request is not None
        request.method = self._parser.get_method()
        request.keep_alive = self._parser.should_keep_alive()
        _set_target(request, b"".join(self._url))
        request.request_id = request_id(request.header(b"x-request-id"))
        request.http_10 = self._parser.get_http_version() == "1.0"
        self._limit = body_limit(request.path, self.app.max_body_bytes)
        declared = request.header(b"content-length")
        if declared is not None and declared.isdigit():
            self._declared = int(declared)
            self._too_big = self._declared > self._limit
        if request.header(b"expect") == b"100-continue":
            self._continue(request)

    def _continue(self, request: Request) -> None:
        """A client waiting for leave to send its body (curl, for bodies over 1 KiB) gets it at once, or
        the 413 straight away: its body then may or may not follow, so the connection closes after it."""
        if self._too_big:
            request.keep_alive = False
            self._broken = True
            self._partial = None
            self._enqueue(request, error_reply(self._limit_error() or body_too_large(""), request.path))
            raise StopParsing
        elif not self.busy:  # behind a pipelined answer it would interleave; the client then sends anyway
            self.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        self._size += len(body)
        if self._too_big:
            return
        if self._size > self._limit:  # read on, and dropped: the connection stays usable
            self._too_big = True
            self._body = []
            return
        self._body.append(body)

    def on_message_complete(self) -> None:
        request = self._partial
        assert request is not None
        self._partial = None
        request.body = b"".join(self._body)
        self._body = []
        error = self._limit_error()
        self._enqueue(request, None if error is None else error_reply(error, request.path))

    # --- answering ----------------------------------------------------------------------------------

    def _limit_error(self) -> ApiError | None:
        if not self._too_big:
            return None
        return body_too_large(f"request body larger than {self._limit} bytes")

    def _refuse(self, message: str) -> None:
        """The parser lost the request's framing: a 400 after what is queued, then the connection closes."""
        self._broken = True
        self._partial = None
        stub = Request(
            method=b"", target=b"/", path="/", query=b"", headers=[], body=b"",
            arrived=time.monotonic(), keep_alive=False, request_id=request_id(None),
        )  # fmt: skip
        logger.info("refused a request the HTTP parser could not read (request id %s)", stub.request_id)
        self._enqueue(stub, error_reply(bad_request(message), "/"))

    def _check_idle(self) -> None:
        """Once per IDLE_S at most: close a connection the client left silent, answering 408 first where
        it stopped inside a request."""
        silent = self._loop.time() - self._last_data
        if self.busy or silent < IDLE_S:
            self._idle_timer = self._loop.call_later(
                IDLE_S - silent if silent < IDLE_S else IDLE_S, self._check_idle
            )
            return
        self._idle_timer = None
        partial = self._partial
        if partial is None or self._broken:
            self.close()
            return
        self._broken = True
        self._partial = None
        if not partial.request_id:
            partial.request_id = request_id(None)
        partial.keep_alive = False
        error = ApiError(408, "the request was not received in time", code="request_timeout")
        self._enqueue(partial, error_reply(error, partial.path))

    def _upgrade(self) -> None:
        """No protocol switch here, and what follows an upgrade request is not HTTP/1.1: a complete request
        is answered and the connection then closes."""
        if self._partial is not None:
            self._refuse("invalid HTTP request: protocol upgrades are not supported")
        elif self._queue:
            self._broken = True
            self._queue[-1][0].keep_alive = False

    def _enqueue(self, request: Request, ready: Reply | None) -> None:
        begun: Reply | Pending | None = ready
        if ready is None and not self.busy:  # behind another answer, it waits its turn in the task
            begun = self.app.begin(request)
        self._queue.append((request, begun))
        if len(self._queue) >= MAX_PIPELINED and self.transport is not None:
            self.transport.pause_reading()
        if self._task is None:
            self._task = self._loop.create_task(self._run())

    async def _run(self) -> None:
        try:
            while self._queue and not self.closed:
                request, ready = self._queue.popleft()
                if len(self._queue) == MAX_PIPELINED - 1 and self.transport is not None:
                    self.transport.resume_reading()
                last = self._eof and not self._queue
                keep = request.keep_alive and not last
                if isinstance(ready, Reply):
                    self.write(reply_bytes(ready, request.request_id, keep))
                else:
                    try:
                        keep = await self._answer(request, ready, keep)
                    except Exception:  # Router.handle answers its errors: this one broke a relay under way
                        logger.exception("relay failed (request id %s)", request.request_id)
                        self.abort()
                        return
                if not keep:
                    self._finish()
                    return
        finally:
            self._task = None
        if self._eof and not self._queue:
            self.close()

    async def _answer(self, request: Request, begun: Pending | None, keep: bool) -> bool:
        """Answer `request`; whether the connection stays open after it."""
        answer = await self.app.handle(request, begun)
        if isinstance(answer, Reply):
            self.write(reply_bytes(answer, request.request_id, keep))
            return keep
        return await answer.send(self, request, keep)

    def write(self, data: bytes) -> None:
        if not self.closed and self.transport is not None:
            self.transport.write(data)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def _finish(self) -> None:
        """Close after the last answer. Where the client may still be sending, our side closes first and
        what still arrives is read and dropped for a moment: a close with unread bytes resets the
        connection, and a reset can discard the answer before the client has read it."""
        if self._eof or self.transport is None or self.transport.is_closing():
            self.close()
            return
        self._broken = True
        self.transport.resume_reading()
        self.transport.write_eof()
        self._loop.call_later(LINGER_S, self.close)

    def abort(self) -> None:
        """End the connection mid-answer: the client sees a broken response, never a wrong one."""
        if self.transport is not None:
            self.transport.abort()


def _set_target(request: Request, url: bytes) -> None:
    if not url.startswith(b"/"):  # absolute form: keep its path
        parsed = httptools.parse_url(url)
        url = (parsed.path or b"/") + (b"?" + parsed.query if parsed.query else b"")
    target, _, request.query = url.partition(b"?")
    request.target = target
    text = target.decode("latin-1")
    request.path = urllib.parse.unquote(text) if "%" in text else text

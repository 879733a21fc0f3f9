"""A node stand-in for router benchmarks: streams a fixed completion at a fixed rate and reports an idle
NodeStatus, so that what is measured is the proxy, not a model. Raw asyncio (uvloop where installed), no
framework, so that it costs little next to the routers it feeds.

    python bench/router_stub.py PORT

POST /v1/completions and /v1/chat/completions answer `text/event-stream`, chunked: `max_tokens` chunks
(default and at most 16), the first at once with the headers, then one every 10 ms, then `data: [DONE]`.
`max_tokens: 1` is a one-write answer, for the requests/s runs. GET /node/status, /health, /ready,
/health_generate, /v1/models, /get_model_info and /get_server_info answer small JSON (what the edgeinfer
router polls and what sglang-router checks at start). HTTP/1.1 keep-alive; one request at a time per
connection.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
import time

CHUNKS = 16
INTERVAL_S = 0.01  # 100 chunks/s after the first, which is sent at once
_MAX_TOKENS = re.compile(rb'"max_tokens"\s*:\s*(\d+)')
_HEAD_END = b"\r\n\r\n"


def _chunk(i: int) -> bytes:
    body = {"id": "cmpl-stub", "object": "text_completion", "choices": [{"index": 0, "text": f" t{i}"}]}
    data = b"data: " + json.dumps(body).encode() + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(data), data)


_FRAMED = [_chunk(i) for i in range(CHUNKS)]
_DONE = b"%x\r\n%s\r\n0\r\n\r\n" % (len(b"data: [DONE]\n\n"), b"data: [DONE]\n\n")
_SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
    b"transfer-encoding: chunked\r\n\r\n"
)


def _json(status: int, body: object) -> bytes:
    data = json.dumps(body).encode()
    reason = {200: b"OK", 404: b"Not Found"}.get(status, b"Status")
    return b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
        status,
        reason,
        len(data),
        data,
    )


def _status() -> bytes:
    return _json(
        200,
        {
            "node_id": "stub",
            "location": "FRA",
            "models_available": ["stub"],
            "models_warm": ["stub"],
            "capacity": 1024,
            "ts": time.time(),
        },
    )


_STATIC = {
    b"/health": _json(200, {"status": "ok"}),
    b"/ready": _json(200, {"status": "ok"}),
    b"/health_generate": _json(200, {"status": "ok"}),
    b"/v1/models": _json(200, {"object": "list", "data": [{"id": "stub", "object": "model"}]}),
    b"/get_model_info": _json(200, {"model_path": "stub", "is_generation": True}),
    b"/get_server_info": _json(200, {"model_path": "stub"}),
}
_NOT_FOUND = _json(404, {"error": "not found"})


class StubProtocol(asyncio.Protocol):
    def __init__(self) -> None:
        self.buf = b""
        self.transport: asyncio.Transport | None = None
        self.streaming = False  # a response is being streamed: further requests wait in buf
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.transport = None

    def data_received(self, data: bytes) -> None:
        self.buf += data
        self._serve()

    def _serve(self) -> None:
        while not self.streaming and self.transport is not None:
            end = self.buf.find(_HEAD_END)
            if end < 0:
                return
            head = self.buf[:end]
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            if len(self.buf) < end + 4 + length:
                return
            body = self.buf[end + 4 : end + 4 + length]
            self.buf = self.buf[end + 4 + length :]
            parts = head.split(b" ", 2)
            if len(parts) < 3 or not parts[2].startswith(b"HTTP/1."):
                self.transport.close()  # sglang-router probes for HTTP/2 first
                return
            method, path = parts[0], parts[1]
            path = path.split(b"?", 1)[0]
            if method == b"POST" and path in (b"/v1/completions", b"/v1/chat/completions"):
                match = _MAX_TOKENS.search(body)
                n = min(CHUNKS, max(1, int(match.group(1)))) if match else CHUNKS
                self._stream(n)
            elif path == b"/node/status":
                self.transport.write(_status())
            else:
                self.transport.write(_STATIC.get(path, _NOT_FOUND))

    def _stream(self, n: int) -> None:
        assert self.transport is not None
        if n == 1:
            self.transport.write(_SSE_HEAD + _FRAMED[0] + _DONE)
            return
        self.streaming = True
        self.transport.write(_SSE_HEAD + _FRAMED[0])
        loop = asyncio.get_running_loop()
        start = loop.time()

        def step(i: int) -> None:
            self.timer = None
            if self.transport is None:
                return
            if i < n - 1:
                self.transport.write(_FRAMED[i])
                # Scheduled from the stream's start, so that late callbacks do not stretch it.
                self.timer = loop.call_at(start + (i + 1) * INTERVAL_S, step, i + 1)
                return
            self.transport.write(_FRAMED[i] + _DONE)
            self.streaming = False
            self._serve()

        self.timer = loop.call_at(start + INTERVAL_S, step, 1)


async def serve(port: int, host: str = "127.0.0.1") -> asyncio.Server:
    loop = asyncio.get_running_loop()
    return await loop.create_server(StubProtocol, host, port, backlog=4096)


def new_event_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def main() -> None:
    async def forever() -> None:
        server = await serve(int(sys.argv[1]))
        async with server:
            await server.serve_forever()

    loop = new_event_loop()
    try:
        loop.run_until_complete(forever())
    finally:
        loop.close()


if __name__ == "__main__":
    main()

"""A lean HTTP/1.1 client for load generation on the machine under test.

A load generator on the same cores as the server takes CPU from it: httpx spends ~1.5-2 ms of CPU per
small request, as much as the node spends serving it, so at 200 requests/s it alone holds a third of a
core. This client writes each request in one call and reads the response by Content-Length over
keep-alive connections (~0.1 ms a request), so the server keeps the machine. It speaks just enough HTTP
for JSON requests to our node and no more (no chunked bodies, no TLS, no redirects).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any


class LeanClient:
    """POSTs JSON to one host over at most `max_connections` keep-alive connections."""

    def __init__(self, url: str, max_connections: int = 60) -> None:
        host_port = url.removeprefix("http://").rstrip("/")
        self.host, _, port = host_port.partition(":")
        self.port = int(port or 80)
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self._slots = asyncio.Semaphore(max_connections)

    async def post_json(self, path: str, payload: Any) -> tuple[int, bytes]:
        """(status, body) of one POST; a kept-alive connection the server has closed meanwhile is
        replaced, once."""
        body = json.dumps(payload).encode()
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        async with self._slots:
            while True:
                reused = bool(self._idle)
                conn = self._idle.pop() if reused else await self._connect()
                try:
                    status, data, keep = await _exchange(conn, head + body)
                except (ConnectionError, asyncio.IncompleteReadError):
                    conn[1].close()
                    if reused:
                        continue
                    raise
                if keep:
                    self._idle.append(conn)
                else:
                    conn[1].close()
                return status, data

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection(self.host, self.port)

    async def aclose(self) -> None:
        for _, writer in self._idle:
            writer.close()
        self._idle.clear()


async def _exchange(
    conn: tuple[asyncio.StreamReader, asyncio.StreamWriter], request: bytes
) -> tuple[int, bytes, bool]:
    reader, writer = conn
    writer.write(request)
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    fields = (line.partition(":") for line in lines[1:] if line)
    headers = {name.strip().lower(): value.strip() for name, _, value in fields}
    if "content-length" not in headers:
        raise ValueError(f"response without Content-Length (status {status})")
    data = await reader.readexactly(int(headers["content-length"]))
    return status, data, headers.get("connection", "").lower() != "close"

"""HTTP/1.1 as the router's data plane writes it: a parsed client request, whole answers (`Reply`), response
heads, and error answers in the route's envelope. Header names and values stay bytes from the socket to the
node and back, so whatever bytes a client sent pass unchanged."""

from __future__ import annotations

import os
import random
import secrets
from dataclasses import dataclass, field
from http import HTTPStatus

import orjson

from edgeinfer.api.errors import ApiError
from edgeinfer.api.http.request_ids import request_id_of

JSON = b"application/json"
_PHRASES = {s.value: s.phrase.encode() for s in HTTPStatus}


@dataclass(slots=True, kw_only=True)
class Request:
    """One client request, its body complete. `path` is percent-decoded (for matching); `target` is the
    path as the client sent it, without the query (what the node gets)."""

    method: bytes
    target: bytes
    path: str
    query: bytes
    headers: list[tuple[bytes, bytes]]  # names lower-cased
    body: bytes
    arrived: float  # monotonic seconds, before the body was read
    keep_alive: bool
    http_10: bool = False  # an HTTP/1.0 client: no chunked framing; its answer ends with the connection
    request_id: str = ""
    _index: dict[bytes, bytes] | None = field(default=None, repr=False)

    def header(self, name: bytes) -> bytes | None:
        """The first value of header `name` (lower case)."""
        if self._index is None:
            self._index = {}
            for key, value in self.headers:
                self._index.setdefault(key, value)
        return self._index.get(name)

    def text_header(self, name: bytes) -> str | None:
        value = self.header(name)
        return None if value is None else value.decode("latin-1")


# New request ids: 128 random bits, unique rather than secret (they name a request, they do not
# authorize it), so drawn from a generator seeded by the OS, not from a system call per request. A worker
# forked from another draws its own.
_IDS = random.Random(secrets.randbits(128))
os.register_at_fork(after_in_child=lambda: _IDS.seed(secrets.randbits(128)))


def request_id(client_value: bytes | None) -> str:
    """The client's own `x-request-id` when it is tame (as on a node), else a new one."""
    if client_value is None:
        return f"{_IDS.getrandbits(128):032x}"
    return request_id_of({"headers": [(b"x-request-id", client_value)]})


@dataclass(slots=True)
class Reply:
    """A whole answer the router makes itself (errors, ops routes)."""

    status: int
    body: bytes
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    content_type: bytes | None = JSON  # None: `headers` has the node's own


def json_reply(value: object, status: int = 200) -> Reply:
    return Reply(status, orjson.dumps(value))


def error_reply(error: ApiError, path: str) -> Reply:
    """`error` in the envelope of the route (OpenAI's, or Workers AI's on /ai/run), `Retry-After` included."""
    headers = [(k.lower().encode(), v.encode()) for k, v in error.headers().items()]
    return Reply(error.status, orjson.dumps(error.body_for(path)), headers)


def head(status: int, headers: list[tuple[bytes, bytes]], framing: bytes, keep_alive: bool) -> bytes:
    """A response head: status line, `headers`, then `framing` (a content-length or transfer-encoding line,
    CRLF included) and `connection: close` where the connection ends after this answer."""
    parts = [b"HTTP/1.1 %d %s\r\n" % (status, _PHRASES.get(status, b"Unknown"))]
    parts += [b"%s: %s\r\n" % pair for pair in headers]
    parts.append(framing)
    if not keep_alive:
        parts.append(b"connection: close\r\n")
    parts.append(b"\r\n")
    return b"".join(parts)


def reply_bytes(reply: Reply, request_id: str, keep_alive: bool) -> bytes:
    headers = [*reply.headers, (b"x-request-id", request_id.encode())]
    if reply.content_type is not None:
        headers.insert(0, (b"content-type", reply.content_type))
    framing = b"content-length: %d\r\n" % len(reply.body)
    return head(reply.status, headers, framing, keep_alive) + reply.body

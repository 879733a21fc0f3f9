"""Answers written before any ASGI app sees a request, in OpenAI's error shape and with an `x-request-id`,
as the app's own are: a request that uvicorn's HTTP parser (h11 or httptools) refuses, and a connection
over the per-client bound (connections.py).

uvicorn answers a request its parser refuses (a NUL or a newline in a header, `Content-Length: -1`, a
malformed request line) from its protocol class, with a plain-text 400, and closes the connection: the
request's framing is lost, so no later request on it could be read. `JSONParserErrors` replaces that
answer; the connection still closes. The route shape (Workers AI's envelope on /ai/run) cannot be chosen:
the parser refused the request before its path was known.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from http import HTTPStatus

from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger("edgeinfer.http")

PARSER_REJECTED = "invalid HTTP request: malformed request line or headers, or invalid framing"


def raw_error(
    status: int, message: str, *, type: str, code: str, headers: tuple[tuple[str, str], ...] = ()
) -> tuple[str, bytes]:
    """A whole HTTP/1.1 error response that closes its connection, and its request id."""
    request_id = uuid.uuid4().hex
    error = {"message": message, "type": type, "param": None, "code": code}
    body = json.dumps({"error": error}).encode()
    lines = [
        f"HTTP/1.1 {status} {HTTPStatus(status).phrase}",
        "content-type: application/json",
        "connection: close",
        *(f"{name}: {value}" for name, value in headers),
        f"x-request-id: {request_id}",
        f"content-length: {len(body)}",
    ]
    return request_id, ("\r\n".join(lines) + "\r\n\r\n").encode() + body


class JSONParserErrors:
    """Mixin for a uvicorn HTTP protocol class: its answer to a request the parser refuses."""

    transport: asyncio.Transport
    client: tuple[str, int] | None

    def send_400_response(self, msg: str) -> None:
        request_id, response = raw_error(
            400, PARSER_REJECTED, type="invalid_request_error", code="bad_request"
        )
        logger.info("refused a request the HTTP parser could not read (request id %s)", request_id)
        self.transport.write(response)
        self.transport.close()


class JSONErrorsH11Protocol(JSONParserErrors, H11Protocol):
    """uvicorn's h11 protocol with `JSONParserErrors`."""


def http_protocol(name: str) -> type[asyncio.Protocol]:
    """uvicorn's protocol class `name` ("h11" or "httptools") with `JSONParserErrors`."""
    if name == "h11":
        return JSONErrorsH11Protocol
    if name == "httptools":
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        class JSONErrorsHttpToolsProtocol(JSONParserErrors, HttpToolsProtocol):
            """uvicorn's httptools protocol with `JSONParserErrors`."""

        return JSONErrorsHttpToolsProtocol
    raise ValueError(f"unknown HTTP implementation {name!r} (h11 or httptools)")

"""Raw HTTP/1.1 on a socket, for requests no client library sends (a NUL in a header, a negative
Content-Length), and the check of the server's answer to them."""

from __future__ import annotations

import json
import socket


def send_raw(port: int, request: bytes) -> bytes:
    """`request` on a new connection to loopback `port`; everything the server sends until it closes it."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def assert_json_400(answer: bytes) -> None:
    """A 400 in OpenAI's error shape with a request id, on a connection the server closes."""
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    assert lines[0] == "HTTP/1.1 400 Bad Request", answer
    assert headers["content-type"] == "application/json" and headers["connection"] == "close"
    assert len(headers["x-request-id"]) == 32
    error = json.loads(body)["error"]
    assert error["type"] == "invalid_request_error" and "invalid HTTP request" in error["message"]

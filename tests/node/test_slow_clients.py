"""Slow, stalled and greedy clients hold nothing for long: header and body deadlines, a bound on connections
per address, a write timeout for streams nobody reads, and a shutdown that aborts what outlives its grace."""

from __future__ import annotations

import json
import socket
import time

import httpx

from edgeinfer.node.billing.metering import UsageStore
from edgeinfer.node.config import ConnectionLimits

STREAM = {
    "model": "tiny",
    "prompt": "Hello",
    "max_tokens": 480,
    "ignore_eos": True,
    "logprobs": 20,  # ~1 KB per event: the stream outgrows every socket buffer
    "stream": True,
}


def _connect(port: int, small_buffer: bool = False) -> socket.socket:
    sock = socket.socket()
    if small_buffer:  # the client's receive window stays tiny, so the server's writes back up quickly
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.settimeout(10)
    return sock


def _post_head(path: str, length: int) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nhost: test\r\ncontent-type: application/json\r\n"
        f"content-length: {length}\r\n\r\n"
    ).encode()


def _read_all(sock: socket.socket) -> bytes:
    """Everything until the server closes the connection (socket.timeout if it never does)."""
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def _stalled_stream(node) -> socket.socket:
    sock = _connect(node.port, small_buffer=True)
    deadline = time.monotonic() + 10
    while node.shrink_send_buffers() < 1:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    body = json.dumps(STREAM).encode()
    sock.sendall(_post_head("/v1/completions", len(body)) + body)
    assert sock.recv(64).startswith(b"HTTP/1.1 200")
    return sock  # and never read again


def _records(path: str) -> list:
    store = UsageStore(path)
    try:
        return store.records("default")
    finally:
        store.close()


def test_header_and_body_deadlines_and_connections_per_client(node_factory, tiny_llama_dir) -> None:
    limits = ConnectionLimits(header_timeout_s=1.0, body_timeout_s=1.0, max_connections_per_client=6)
    node = node_factory({"tiny": tiny_llama_dir}, connections=limits)
    half_headers = [_connect(node.port) for _ in range(3)]
    for sock in half_headers:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: test\r\n")
    half_bodies = [_connect(node.port) for _ in range(3)]
    for sock in half_bodies:
        sock.sendall(_post_head("/v1/completions", 100) + b"{")
    extra = _connect(node.port)  # the seventh from this address
    extra.sendall(b"GET /health HTTP/1.1\r\nhost: test\r\n\r\n")
    refused = _read_all(extra)
    assert refused.startswith(b"HTTP/1.1 429") and b"x-request-id: " in refused
    started = time.monotonic()
    assert [_read_all(s) for s in half_headers] == [b""] * 3  # closed without an answer
    for sock in half_bodies:
        answer = _read_all(sock)
        assert answer.startswith(b"HTTP/1.1 408") and b"x-request-id: " in answer
    assert time.monotonic() - started < 5
    assert httpx.get(node.url + "/health").status_code == 200  # the address has its connections back


def test_a_stream_nobody_reads_is_aborted(node_factory, tiny_llama_dir) -> None:
    limits = ConnectionLimits(stream_write_timeout_s=1.0)
    node = node_factory({"tiny": tiny_llama_dir}, preload=("tiny",), connections=limits)
    sock = _stalled_stream(node)
    node.service.store.flush()
    deadline = time.monotonic() + 20
    while not node.service.store.records("default"):
        assert time.monotonic() < deadline, "the stalled stream was never ended"
        time.sleep(0.1)
        node.service.store.flush()
    (record,) = node.service.store.records("default")
    assert record.status == 499
    assert b"[DONE]" not in _read_all(sock)  # the server dropped the connection mid-stream
    node.wait_idle("tiny")
    node.engine("tiny").check_integrity()
    assert node.service.pool.in_flight("tiny") == 0 and node.service.capacity.admitted("tiny") == 0


def test_shutdown_aborts_what_outlives_its_grace(node_factory, tiny_llama_dir) -> None:
    limits = ConnectionLimits(shutdown_grace_s=1.0, stream_write_timeout_s=300.0)
    node = node_factory({"tiny": tiny_llama_dir}, preload=("tiny",), connections=limits)
    sock = _stalled_stream(node)
    # every token is computed (the engine never waits on a reader), most of them never written
    node.wait_idle("tiny", timeout=60)
    started = time.monotonic()
    node.stop()
    assert time.monotonic() - started < 10
    sock.close()
    (record,) = _records(node.service.store.path)
    assert record.status == 499
    assert record.output_tokens == STREAM["max_tokens"]  # billed what the engine computed

"""No input drops a connection without an answer (issue 45): deeply nested, oversized, invalid-UTF-8 and
truncated bodies, malformed HTTP, pipelined requests, each over one raw keep-alive socket to a router in front
of one in-process node. Every answer is JSON in the route's envelope with an `x-request-id`, and where HTTP
framing allows it the same connection then serves a valid request."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from helpers.node_servers import LiveServer, NodeFactory
from helpers.router_fleet import RouterThread, free_port, one_node_fleet

from edgeinfer.api.limits import NodeLimits
from edgeinfer.router import http_server
from edgeinfer.router.config import RouterConfig

LIMIT = 64 * 1024
VALID = b'{"model": "tiny", "prompt": "x", "max_tokens": 1}'
WAI = b"/accounts/a/ai/run/tiny"


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory, tiny_dirs: dict[str, str]) -> Iterator[LiveServer]:
    factory = NodeFactory(tmp_path_factory.mktemp("router-wire"))
    server = factory({"tiny": tiny_dirs["tiny"]}, preload=("tiny",), node_id="w1", location="FRA")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def router(node: LiveServer) -> Iterator[RouterThread]:
    config = RouterConfig(location="FRA", placement=None, seed=0, limits=NodeLimits(max_body_bytes=LIMIT))
    server = RouterThread(config, one_node_fleet("w1", node.url))
    server.start().wait_for_nodes({"w1"})
    yield server
    server.stop()


class Conn:
    """One raw keep-alive connection; `answer` reads one whole response (Content-Length or chunked)."""

    def __init__(self, url: str) -> None:
        self.sock = socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=30)
        self.buf = b""

    def post(self, path: bytes, body: bytes, length: int | None = None, extra: bytes = b"") -> None:
        size = len(body) if length is None else length
        head = b"POST %s HTTP/1.1\r\nhost: r\r\ncontent-type: application/json\r\n" % path
        self.sock.sendall(head + extra + b"content-length: %d\r\n\r\n" % size + body)

    def _more(self) -> None:
        data = self.sock.recv(65536)
        if not data:
            raise ConnectionError("closed")
        self.buf += data

    def _take(self, n: int) -> bytes:
        while len(self.buf) < n:
            self._more()
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def _line(self) -> bytes:
        while b"\r\n" not in self.buf:
            self._more()
        line, self.buf = self.buf.split(b"\r\n", 1)
        return line

    def answer(self) -> tuple[int, dict[str, str], bytes]:
        while b"\r\n\r\n" not in self.buf:
            self._more()
        head, self.buf = self.buf.split(b"\r\n\r\n", 1)
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.lower(): v for k, v in (line.split(": ", 1) for line in lines[1:])}
        status = int(lines[0].split()[1])
        if status < 200:  # interim: no body
            return status, headers, b""
        if "content-length" in headers:
            return status, headers, self._take(int(headers["content-length"]))
        body = b""
        while size := int(self._line(), 16):
            body += self._take(size)
            self._take(2)
        self._take(2)
        return status, headers, body

    def closed_by_peer(self) -> bool:
        self.sock.settimeout(10)
        return self.buf == b"" and self.sock.recv(1) == b""

    def close(self) -> None:
        self.sock.close()


@pytest.fixture()
def conn(router: RouterThread) -> Iterator[Conn]:
    c = Conn(router.url)
    yield c
    c.close()


def _error(status: int, headers: dict[str, str], body: bytes, workers_ai: bool = False) -> str:
    assert headers["content-type"] == "application/json" and len(headers["x-request-id"]) == 32
    parsed = json.loads(body)
    return parsed["errors"][0]["message"] if workers_ai else parsed["error"]["message"]


def _then_valid(conn: Conn) -> None:
    conn.post(b"/v1/completions", VALID)
    status, headers, body = conn.answer()
    assert status == 200, body
    assert headers["x-edgeinfer-node"] == "w1" and json.loads(body)["choices"]


DEEP = b"[" * 320 + b"]" * 320
DEEPER = b"[" * 5000 + b"]" * 5000  # past orjson's own recursion limit: the standard parser decides
NESTED = "nested deeper than"
BAD = [
    (b"/v1/completions", b'{"model": "tiny", "prompt": "x", "stop": ' + DEEP + b"}", 400, NESTED),
    (b"/v1/chat/completions", b'{"model": "tiny", "messages": ' + DEEPER + b"}", 400, NESTED),
    (WAI, b'{"prompt": "x", "response_format": ' + DEEP + b"}", 400, NESTED),
    (b"/v1/completions", b'{"model": "tiny", "prompt": "\xff\xfe"}', 400, "not valid UTF-8"),
    (b"/v1/embeddings", b'{"model": "tiny", "input": "\xc3"}', 400, "not valid UTF-8"),
    (b"/v1/completions", b'{"model": "tiny", "prompt": ', 400, "invalid JSON body"),
    (b"/v1/completions", b'{"model": "tiny", "prompt": "' + b"x" * LIMIT + b'"}', 413, "larger than"),
    (WAI, b'{"prompt": "' + b"x" * (4 * LIMIT) + b'"}', 413, "larger than"),
    (b"/v1/completions", b'{"model": "nope", "prompt": "x"}', 404, "does not exist"),
]


@pytest.mark.parametrize(("path", "body", "status", "words"), BAD)
def test_bad_bodies_get_an_enveloped_4xx_and_the_connection_serves_on(
    conn: Conn, path: bytes, body: bytes, status: int, words: str
) -> None:
    conn.post(path, body)
    got, headers, answer = conn.answer()
    assert got == status, answer
    assert words in _error(got, headers, answer, workers_ai=path == WAI)
    _then_valid(conn)


def test_a_declared_length_over_the_limit_is_read_and_refused(conn: Conn) -> None:
    conn.post(b"/v1/completions", b"x" * (LIMIT + 1), extra=b"x-request-id: trace-7\r\n")
    status, headers, body = conn.answer()
    assert status == 413 and headers["x-request-id"] == "trace-7"
    assert json.loads(body)["error"]["code"] == "body_too_large"
    _then_valid(conn)


def test_a_body_cut_short_by_a_half_close_is_answered_before_the_close(conn: Conn) -> None:
    conn.post(b"/v1/completions", VALID[:10], length=len(VALID))
    conn.sock.shutdown(socket.SHUT_WR)
    status, headers, body = conn.answer()
    assert status == 400 and "truncated" in _error(status, headers, body)
    assert headers["connection"] == "close" and conn.closed_by_peer()


def test_a_head_cut_short_by_a_half_close_is_answered_before_the_close(conn: Conn) -> None:
    conn.sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: r\r\ncontent-")
    conn.sock.shutdown(socket.SHUT_WR)
    status, headers, body = conn.answer()
    assert status == 400 and "invalid HTTP request" in _error(status, headers, body)
    assert conn.closed_by_peer()


def test_malformed_http_after_a_valid_request_answers_both(conn: Conn) -> None:
    conn.post(b"/v1/completions", VALID)
    conn.sock.sendall(b"GET /health HTTP/1.1\r\nhost: r\r\nx-bad: a\x00b\r\n\r\n")
    assert conn.answer()[0] == 200
    status, headers, body = conn.answer()
    assert status == 400 and "invalid HTTP request" in _error(status, headers, body)
    assert headers["connection"] == "close" and conn.closed_by_peer()


def test_pipelined_requests_are_answered_in_order(conn: Conn) -> None:
    wrong = b"POST /v1/completions HTTP/1.1\r\nhost: r\r\nauthorization: x\r\ncontent-length: 2\r\n\r\n{}"
    health = b"GET /health HTTP/1.1\r\nhost: r\r\n\r\n"
    conn.sock.sendall(wrong + health + b"GET /nothing HTTP/1.1\r\nhost: r\r\n\r\n")
    assert [conn.answer()[0] for _ in range(3)] == [400, 200, 404]
    _then_valid(conn)


def test_wrong_methods_and_paths_are_enveloped(conn: Conn) -> None:
    conn.sock.sendall(b"GET /v1/completions HTTP/1.1\r\nhost: r\r\n\r\n")
    status, headers, body = conn.answer()
    assert status == 405 and headers["allow"] == "POST" and _error(status, headers, body)
    conn.sock.sendall(b"DELETE /accounts/a/ai/run/tiny HTTP/1.1\r\nhost: r\r\n\r\n")
    status, headers, body = conn.answer()
    assert status == 405 and json.loads(body)["success"] is False
    _then_valid(conn)


def test_a_stream_is_relayed_chunk_by_chunk(conn: Conn) -> None:
    conn.post(b"/v1/completions", b'{"model": "tiny", "prompt": "x", "max_tokens": 3, "stream": true}')
    status, headers, body = conn.answer()
    assert status == 200 and headers["transfer-encoding"] == "chunked"
    assert headers["content-type"].startswith("text/event-stream")
    assert body.rstrip().endswith(b"data: [DONE]")
    _then_valid(conn)


def test_a_silent_connection_is_closed_and_a_stalled_request_answered_408(
    router: RouterThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(http_server, "IDLE_S", 0.3)
    idle, stalled = Conn(router.url), Conn(router.url)
    try:
        stalled.post(b"/v1/completions", VALID[:5], length=len(VALID))
        status, headers, body = stalled.answer()
        assert status == 408 and _error(status, headers, body) and stalled.closed_by_peer()
        assert idle.closed_by_peer()
    finally:
        idle.close()
        stalled.close()


def test_workers_share_the_port_and_stop_together(node: LiveServer, tmp_path: Path) -> None:
    fleet = tmp_path / "fleet.toml"
    fleet.write_text(
        '[[locations]]\ncode = "FRA"\nlat = 50.0\nlon = 8.5\n'
        f'[[locations.nodes]]\nid = "w1"\nurl = "{node.url}"\n'
    )
    port = free_port()
    cmd = [sys.executable, "-m", "edgeinfer.cli", "router", "--fleet", str(fleet), "--location", "FRA"]
    proc = subprocess.Popen([*cmd, "--port", str(port), "--workers", "2"], stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/ready", timeout=1).status_code == 200:
                    break
            time.sleep(0.1)
        # New connections each: the kernel spreads them over the workers listening. /ready answered by
        # one worker says nothing of the other's start, so rounds go on until both have routed some.
        sent, counts = 0, {0.0}
        while time.monotonic() < deadline and (min(counts) == 0 or max(counts) == sent):
            for _ in range(16):
                conn = Conn(url)
                conn.post(b"/v1/completions", VALID)
                status, headers, _ = conn.answer()
                conn.close()
                assert status == 200 and headers["x-edgeinfer-node"] == "w1"
            sent += 16
            counts = {routed(url) for _ in range(24)}
        # Each worker counts its own: a share of what was sent, the other worker the rest.
        share = min(counts)
        assert 0 < share < sent and counts <= {share, sent - share}, counts
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, proc.stderr.read().decode() if proc.stderr else ""


def routed(url: str) -> float:
    """The requests routed by the worker that answers this new connection, from its own /metrics."""
    with httpx.Client(timeout=5) as client:
        text = client.get(url + "/metrics").text
    prefix = "edgeinfer_router:routed_requests_total{"
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(prefix))


def test_a_client_expecting_100_continue_gets_it_or_the_413_at_once(conn: Conn) -> None:
    conn.sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nhost: r\r\ncontent-type: application/json\r\n"
        b"expect: 100-continue\r\ncontent-length: %d\r\n\r\n" % len(VALID)
    )
    assert conn.answer()[0] == 100
    conn.sock.sendall(VALID)
    assert conn.answer()[0] == 200
    conn.sock.sendall(  # the body comes anyway, at once: it is not read as a request
        b"POST /v1/completions HTTP/1.1\r\nhost: r\r\nexpect: 100-continue\r\ncontent-length: %d\r\n\r\n"
        % (LIMIT + 1)
        + b"GET /health HTTP/1.1\r\n\r\n" * 1000
    )
    status, headers, body = conn.answer()
    assert status == 413 and _error(status, headers, body) and conn.closed_by_peer()


def test_an_http_10_client_gets_the_stream_unframed_then_the_close(conn: Conn) -> None:
    body = b'{"model": "tiny", "prompt": "x", "max_tokens": 2, "stream": true}'
    conn.sock.sendall(
        b"POST /v1/completions HTTP/1.0\r\nconnection: keep-alive\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%s" % (len(body), body)
    )
    conn.sock.settimeout(30)
    while chunk := conn.sock.recv(65536):
        conn.buf += chunk
    head, _, text = conn.buf.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding" not in head.lower()
    assert text.rstrip().endswith(b"data: [DONE]")

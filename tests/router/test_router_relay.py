"""The relay of a node's answer at the wire (router/upstream.py, router/proxy.py), against a scripted node
that writes its answer in chosen pieces: bodies split anywhere (inside a chunk-size line, inside a chunk's
data, between a chunk and its CRLF) reach the client intact and the node's connection is reused after; a
node that dies or falls silent mid-stream ends the client's stream broken, never as a complete answer; the
first-byte deadline is a 504 in the envelope; a client that reads slowly still gets every byte."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import json
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import pytest
from helpers.router_fleet import RouterThread, free_port, one_node_fleet

from edgeinfer.router.config import RouterConfig
from edgeinfer.router.metrics import PREFIX
from edgeinfer.router.proxy import Forward, Relay
from edgeinfer.router.wire import Request

SSE = [b'data: {"text": "piece %d"}\n\n' % i for i in range(12)] + [b"data: [DONE]\n\n"]
PAYLOAD = b"".join(SSE)
FRAMED = b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in SSE) + b"0\r\n\r\n"
CHUNKED_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
LENGTH_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: %d\r\n\r\n" % len(
    PAYLOAD
)
BIG = b"x" * (8 << 20)  # more than the sockets between node, router and client hold: the relay must pause
PAUSE_S = 0.02  # between the scripted node's writes: each one a read of its own at the router


def _pieces(data: bytes, cuts: list[int]) -> list[bytes]:
    bounds = [0, *cuts, len(data)]
    return [data[a:b] for a, b in itertools.pairwise(bounds)]


def _split_everywhere() -> list[bytes]:
    """The whole answer cut at every kind of place: inside the head, right after it, inside a chunk-size
    line, inside chunk data, between data and its CRLF, inside the last chunk."""
    whole = CHUNKED_HEAD + FRAMED
    head = len(CHUNKED_HEAD)
    first = FRAMED.index(b"\r\n") + 2  # after the first size line
    cuts = [10, head, head + 1, head + first + 3, head + first + len(SSE[0]), head + first + len(SSE[0]) + 1]
    cuts += [len(whole) - 4, len(whole) - 1]
    return _pieces(whole, sorted(set(cuts)))


class ScriptedNode:
    """A node stand-in on its own event loop: /node/status says it serves `tiny`; POST answers per the
    request's `prompt` (a script name). Counts the connections the router opened."""

    def __init__(self) -> None:
        self.port = free_port()
        self.connections = 0
        self.dropped = 0  # trickling answers whose connection the router dropped
        self.prompts: queue.Queue[str] = queue.Queue()  # of the requests received, as they arrive
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _run(self) -> None:
        async def main() -> None:
            self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
            self._ready.set()
            await self._server.serve_forever()

        with contextlib.suppress(asyncio.CancelledError):
            self._loop.run_until_complete(main())

    def start(self) -> ScriptedNode:
        self._thread.start()
        self._ready.wait(10)
        return self

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._server.close)
        self._thread.join(5)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                body = await reader.readexactly(length)
                if head.startswith(b"GET /node/status"):
                    status = {"node_id": "s1", "location": "FRA", "models_available": ["tiny"]}
                    data = json.dumps({**status, "models_warm": ["tiny"], "capacity": 64, "ts": time.time()})
                    writer.write(
                        b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(data), data.encode())
                    )
                    continue
                prompt = json.loads(body)["prompt"]
                self.prompts.put(prompt)
                if not await self._answer(prompt, writer):
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        finally:
            writer.close()

    async def _answer(self, script: str, writer: asyncio.StreamWriter) -> bool:
        """Write the scripted answer; whether the connection stays open for the next request."""
        if script == "silent":
            await asyncio.sleep(30)
            return False
        if script == "trickle":  # a long stream, until the router drops it
            writer.write(CHUNKED_HEAD)
            try:
                for _ in range(200):
                    writer.write(b"%x\r\n%s\r\n" % (len(SSE[0]), SSE[0]))
                    await writer.drain()
                    await asyncio.sleep(PAUSE_S)
            except ConnectionError:
                self.dropped += 1
            return False
        if script == "big":
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
            for part in _pieces(BIG, list(range(1 << 20, len(BIG), 1 << 20))):
                writer.write(b"%x\r\n%s\r\n" % (len(part), part))
                await writer.drain()
            writer.write(b"0\r\n\r\n")
            return True
        pieces = {
            "split": _split_everywhere(),
            "length": _pieces(LENGTH_HEAD + PAYLOAD, [len(LENGTH_HEAD) + 5, len(LENGTH_HEAD) + 40]),
            "die": [CHUNKED_HEAD + FRAMED[:60]],
            "stall": [CHUNKED_HEAD + FRAMED[:60]],
        }[script]
        for piece in pieces:
            writer.write(piece)
            await writer.drain()
            await asyncio.sleep(PAUSE_S)
        if script == "die":
            writer.transport.abort()
            return False
        if script == "stall":
            await asyncio.sleep(30)
            return False
        return True


@pytest.fixture(scope="module")
def node() -> Iterator[ScriptedNode]:
    server = ScriptedNode().start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def router(node: ScriptedNode) -> Iterator[RouterThread]:
    config = RouterConfig(
        location="FRA", placement=None, seed=0, first_byte_timeout_s=1.0, idle_timeout_s=1.0, max_attempts=1
    )
    server = RouterThread(config, one_node_fleet("s1", node.url))
    server.start().wait_for_nodes({"s1"})
    yield server
    server.stop()


def _post(client: httpx.Client, script: str) -> httpx.Response:
    return client.post("/v1/completions", json={"model": "tiny", "prompt": script, "max_tokens": 4})


def _eventually(check: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


@pytest.mark.parametrize("script", ["split", "length"])
def test_an_answer_split_anywhere_arrives_whole_and_the_node_connection_is_reused(
    router: RouterThread, node: ScriptedNode, script: str
) -> None:
    with httpx.Client(base_url=router.url, timeout=10) as client:
        first = _post(client, "split")  # a kept-alive connection to the node exists from here on
        assert first.status_code == 200 and first.content == PAYLOAD
        opened = node.connections
        for _ in range(3):
            response = _post(client, script)
            assert response.status_code == 200 and response.content == PAYLOAD
            assert (
                response.headers["x-edgeinfer-node"] == "s1" and len(response.headers["x-request-id"]) == 32
            )
            framing = "transfer-encoding" if script == "split" else "content-length"
            assert framing in response.headers
        assert node.connections == opened  # each answer ended cleanly: its connection went back to the pool


@pytest.mark.parametrize("script", ["die", "stall"])
def test_a_node_that_dies_or_stalls_mid_stream_breaks_the_clients_stream(
    router: RouterThread, script: str
) -> None:
    with httpx.Client(base_url=router.url, timeout=10) as client:
        with client.stream("POST", "/v1/completions", json={"model": "tiny", "prompt": script}) as response:
            assert response.status_code == 200
            received = b""
            with pytest.raises(httpx.RemoteProtocolError):
                for part in response.iter_raw():
                    received += part
        assert PAYLOAD.startswith(received) and received  # what came was the node's, unaltered
    # The breaker counted one failure at most: the next request still reaches the node.
    _eventually(lambda: router.service.state.nodes["s1"].breaker.acquire())
    router.service.state.nodes["s1"].breaker.release()
    with httpx.Client(base_url=router.url, timeout=10) as client:
        assert _post(client, "split").content == PAYLOAD


def test_a_node_that_never_answers_is_a_504_after_the_first_byte_deadline(router: RouterThread) -> None:
    started = time.monotonic()
    with httpx.Client(base_url=router.url, timeout=10) as client:
        response = _post(client, "silent")
        assert response.status_code == 504
        assert response.json()["error"]["code"] == "timeout" and response.headers["x-request-id"]
        assert 0.9 < time.monotonic() - started < 5
        assert _post(client, "split").content == PAYLOAD  # the same client connection serves on


def test_a_client_reading_slowly_gets_every_byte(router: RouterThread) -> None:
    body = {"model": "tiny", "prompt": "big"}
    with (
        httpx.Client(base_url=router.url, timeout=30) as client,
        client.stream("POST", "/v1/completions", json=body) as response,
    ):
        size = 0
        for part in response.iter_bytes():
            size += len(part)
            if size < len(BIG) // 2:
                time.sleep(0.001)  # the router's socket buffer fills: it pauses the node's
        assert size == len(BIG)


def test_clients_leaving_mid_stream_drop_the_node_connection_without_counting_against_the_node(
    router: RouterThread, node: ScriptedNode
) -> None:
    breaker = router.service.state.nodes["s1"].breaker
    with httpx.Client(base_url=router.url, timeout=10) as client:
        assert _post(client, "split").content == PAYLOAD
    dropped = node.dropped
    body = {"model": "tiny", "prompt": "trickle"}
    with contextlib.ExitStack() as streams:  # all under way at once, then all their clients leave
        readers = []
        for _ in range(breaker.failure_threshold):
            client = streams.enter_context(httpx.Client(base_url=router.url, timeout=10))
            response = streams.enter_context(client.stream("POST", "/v1/completions", json=body))
            readers.append(response.iter_raw())  # kept: a reader dropped closes its response
            assert next(readers[-1])
    _eventually(lambda: node.dropped == dropped + breaker.failure_threshold)  # long before the idle bound
    deadline = time.monotonic() + 0.2
    while time.monotonic() < deadline:
        assert breaker.state == "closed"
        time.sleep(0.01)


def test_a_relayed_request_leaves_no_cycle_to_the_collector(router: RouterThread) -> None:
    """Every object of a request is freed as the request ends: garbage that only the cycle collector
    frees piles up on a busy router until a full collection stalls every stream in flight."""
    with httpx.Client(base_url=router.url, timeout=10) as client:
        assert _post(client, "split").content == PAYLOAD
        gc.collect()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            for _ in range(5):
                assert _post(client, "split").content == PAYLOAD
            gc.collect()
            left = [type(o).__name__ for o in gc.garbage if isinstance(o, Request | Relay | Forward)]
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
    assert left == []


def _raw_post(script: str) -> bytes:
    body = json.dumps({"model": "tiny", "prompt": script, "max_tokens": 4}).encode()
    head = b"POST /v1/completions HTTP/1.1\r\nhost: r\r\ncontent-type: application/json\r\n"
    head += b"content-length: %d\r\n\r\n" % len(body)
    return head + body


def _tcp_pair() -> tuple[socket.socket, socket.socket]:
    """A loopback TCP connection: (the client's end, the router's end)."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname())
        accepted, _ = server.accept()
    return client, accepted


def _client_closed(router: RouterThread) -> float:
    labels = {"location": "FRA", "node": "s1", "outcome": "client_closed"}
    value = router.service.metrics.registry.get_sample_value(PREFIX + "routed_requests_total", labels)
    return value or 0.0


def test_a_request_on_an_idle_connection_reaches_the_node_in_the_loop_turn_that_read_it(
    router: RouterThread, node: ScriptedNode
) -> None:
    """The router's event loop is held by the first callback scheduled after the request's bytes reached
    its connection (the loop's next turn): the node gets the request all the same, so it went out in the
    turn that read it, not from the step of a task started for it."""
    with httpx.Client(base_url=router.url, timeout=10) as client:
        assert _post(client, "split").content == PAYLOAD  # an idle pooled connection to the node
    while not node.prompts.empty():
        node.prompts.get()
    client_end, router_end = _tcp_pair()

    async def feed_then_hold() -> str | None:
        loop = asyncio.get_running_loop()
        _, conn = await loop.connect_accepted_socket(router.router.protocol, router_end)
        held: asyncio.Future[str | None] = loop.create_future()

        def hold() -> None:
            try:
                held.set_result(node.prompts.get(timeout=2))
            except queue.Empty:
                held.set_result(None)

        conn.data_received(_raw_post("length"))
        loop.call_soon(hold)
        return await held

    assert router.call(feed_then_hold) == "length"
    with client_end:
        client_end.settimeout(10)
        answer = b""
        while not answer.endswith(PAYLOAD):
            data = client_end.recv(65536)
            assert data, answer
            answer += data
    assert answer.startswith(b"HTTP/1.1 200 OK\r\n") and b"x-edgeinfer-node: s1\r\n" in answer


def test_a_request_begun_then_lost_before_its_task_ran_lets_go_of_the_node(
    router: RouterThread, node: ScriptedNode
) -> None:
    """A task cancelled before its first step never runs: the request it would have awaited was begun
    already (sent to the node), and the connection lets go of it. The node hears of it (its connection
    drops), the outcome is the client's, the breaker is untouched."""
    breaker = router.service.state.nodes["s1"].breaker
    with httpx.Client(base_url=router.url, timeout=10) as client:
        assert _post(client, "split").content == PAYLOAD
    dropped, closed = node.dropped, _client_closed(router)
    client_end, router_end = _tcp_pair()

    async def feed_and_lose() -> None:
        loop = asyncio.get_running_loop()
        transport, conn = await loop.connect_accepted_socket(router.router.protocol, router_end)
        conn.data_received(_raw_post("trickle"))
        conn.connection_lost(None)  # as its transport reports a reset: before the task's first step
        transport.abort()

    router.call(feed_and_lose)
    client_end.close()
    assert _client_closed(router) == closed + 1
    _eventually(lambda: node.dropped == dropped + 1)
    assert breaker.state == "closed"

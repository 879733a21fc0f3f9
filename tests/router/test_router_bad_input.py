"""Bad input through the router (issue 42): the node's 4xx in OpenAI's shape with an `x-request-id`, never a
plain-text 500 that drops the keep-alive connection; the HTTP parser's refusals in the same shape; header
bytes passed through unchanged. A router in front of one in-process node, on loopback."""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Iterator

import httpx
import pytest
from helpers.node_servers import LiveServer, NodeFactory
from helpers.raw_http import assert_json_400, send_raw
from helpers.router_fleet import RouterThread, one_node_fleet

from edgeinfer.obs.access_log import ACCESS_LOGGER
from edgeinfer.router.config import RouterConfig
from edgeinfer.types.bounded_json import MAX_JSON_DEPTH

JSON = {"content-type": "application/json"}
DEEP = "[" * 320 + "]" * 320
WAI = "/accounts/a/ai/run/tiny"


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory, tiny_dirs: dict[str, str]) -> Iterator[LiveServer]:
    factory = NodeFactory(tmp_path_factory.mktemp("router-bad-input"))
    server = factory({"tiny": tiny_dirs["tiny"]}, preload=("tiny",), node_id="n1", location="FRA")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def router(node: LiveServer) -> Iterator[RouterThread]:
    server = RouterThread(
        RouterConfig(location="FRA", placement=None, seed=0), one_node_fleet("n1", node.url)
    )
    server.start().wait_for_nodes({"n1"})
    yield server
    server.stop()


def _connection(r: httpx.Response) -> object:
    return r.extensions["network_stream"].get_extra_info("client_addr")


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", '{"model": "tiny", "prompt": "x", "stop": ' + DEEP + "}"),
        ("/v1/chat/completions", '{"model": "tiny", "messages": ' + DEEP + "}"),
        ("/v1/embeddings", '{"model": "tiny", "input": "x", "extra": ' + DEEP + "}"),
        (WAI, '{"prompt": "x", "response_format": ' + DEEP + "}"),
    ],
)
def test_deep_json_is_a_400_with_a_request_id_and_the_connection_stays(
    router: RouterThread, path: str, body: str
) -> None:
    with httpx.Client(base_url=router.url, timeout=60) as client:
        r = client.post(path, content=body, headers=JSON)
        assert r.status_code == 400, r.text
        message = r.json()["errors"][0]["message"] if path == WAI else r.json()["error"]["message"]
        assert f"nested deeper than {MAX_JSON_DEPTH} levels" in message
        assert re.fullmatch("[0-9a-f]{32}", r.headers["x-request-id"])
        after = client.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1})
        assert after.status_code == 200 and _connection(after) == _connection(r)


def test_an_unexpected_error_is_a_json_500_and_the_connection_stays(
    router: RouterThread, monkeypatch
) -> None:
    def broken(*args: object) -> None:  # raised where the request is begun, in the parser's callback
        raise RuntimeError("secret internals")

    monkeypatch.setattr(router.service, "route", broken)
    with httpx.Client(base_url=router.url, timeout=60) as client:
        r = client.post("/v1/completions", json={"model": "tiny", "prompt": "x"})
        assert r.status_code == 500 and "secret" not in r.text
        assert r.headers["x-request-id"] in r.json()["error"]["message"]
        after = client.get("/health")
        assert after.status_code == 200 and _connection(after) == _connection(r)


def test_the_request_id_is_the_clients_or_new_and_reaches_the_node(
    router: RouterThread, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    body = {"model": "tiny", "prompt": "x", "max_tokens": 1}
    own = httpx.post(router.url + "/v1/completions", json=body, headers={"x-request-id": "trace-42"})
    assert own.status_code == 200 and own.headers["x-request-id"] == "trace-42"
    new = httpx.post(router.url + "/v1/completions", json=body, headers={"x-request-id": "not ok!"})
    assert re.fullmatch("[0-9a-f]{32}", new.headers["x-request-id"])
    for path in ("/health", "/nothing"):
        assert re.fullmatch("[0-9a-f]{32}", httpx.get(router.url + path).headers["x-request-id"])
    # The node logs each request under the router's id (its access line is written as its answer ends).
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        logged = {json.loads(r.message).get("request_id") for r in caplog.records if r.name == ACCESS_LOGGER}
        if {"trace-42", new.headers["x-request-id"]} <= logged:
            break
        time.sleep(0.02)
    assert {"trace-42", new.headers["x-request-id"]} <= logged


def test_header_bytes_pass_both_ways_unchanged(router: RouterThread) -> None:
    """The node echoes x-session-affinity: the bytes a client sent come back as they were."""
    body = {"model": "tiny", "prompt": "x", "max_tokens": 1}
    for value in ("café".encode(), b"\xff\xfe", "東京".encode()):
        r = httpx.post(router.url + "/v1/completions", json=body, headers={"x-session-affinity": value})
        assert r.status_code == 200, r.text
        assert r.headers.raw[[k.lower() for k, _ in r.headers.raw].index(b"x-session-affinity")][1] == value


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"GET /health HTTP/1.1\r\nhost: t\r\nx-bad: a\x00b\r\n\r\n",
        b"POST /v1/completions HTTP/1.1\r\nhost: t\r\ncontent-length: -1\r\n\r\n",
    ],
)
def test_what_the_http_parser_refuses_is_a_json_400(router: RouterThread, request_bytes: bytes) -> None:
    assert_json_400(send_raw(int(router.url.rsplit(":", 1)[1]), request_bytes))
    assert httpx.get(router.url + "/health").status_code == 200


def test_bodies_over_the_limit_keep_the_connection(router: RouterThread) -> None:
    big = json.dumps({"model": "tiny", "prompt": "x" * (4 * 1024 * 1024)})
    with httpx.Client(base_url=router.url, timeout=60) as client:
        r = client.post("/v1/completions", content=big, headers=JSON)
        assert r.status_code == 413 and r.headers["x-request-id"]
        after = client.get("/health")
        assert after.status_code == 200 and _connection(after) == _connection(r)

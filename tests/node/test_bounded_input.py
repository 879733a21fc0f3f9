"""Input that reached a 500, passed unchecked or got the wrong status (issue 42): deeply nested JSON, a
non-ASCII router signature, a `response_format` schema that is no schema, unbounded stop token ids, a
usage window that is not a number, requests the HTTP parser refuses, validation errors as 422, and a
shutdown that never said it was draining. Each answer is a 4xx in the route's shape on a live node."""

from __future__ import annotations

import json
import logging
import socket
import time
from collections.abc import Iterator

import httpx
import pytest
from helpers.node_servers import LiveServer, NodeFactory
from helpers.raw_http import assert_json_400, send_raw

from edgeinfer.api import router_trust
from edgeinfer.types.bounded_json import MAX_JSON_DEPTH

SECRET = b"issue-42-router-secret-0123456789"
WAI = "/accounts/acct/ai/run/tiny"
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: str) -> Iterator[LiveServer]:
    """An open node that also trusts a router (so the signed-tenant path and /node/prefetch are reachable)."""
    factory = NodeFactory(tmp_path_factory.mktemp("bounded-input"))
    server = factory({"tiny": tiny_llama_dir}, preload=("tiny",), router_secret=SECRET)
    yield server
    server.stop()


def nested(levels: int) -> str:
    """`levels` arrays inside one another, as JSON text."""
    return "[" * levels + "]" * levels


def _with_field(body: dict, name: str, raw_json: str) -> bytes:
    """`body` with field `name` set to `raw_json` (JSON text that json.dumps could not write itself)."""
    return json.dumps({**body, name: "@@"}).replace('"@@"', raw_json).encode()


def _connection(r: httpx.Response) -> object:
    """The client side of the connection that carried `r` (a new one after the server dropped the last)."""
    return r.extensions["network_stream"].get_extra_info("client_addr")


def _error(r: httpx.Response, path: str) -> dict:
    body = r.json()
    if path.startswith("/accounts/"):
        assert body["success"] is False and body["result"] is None
        return {"message": body["errors"][0]["message"]}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "invalid_request_error"
    return body["error"]


DEEP_CASES = [
    ("/v1/completions", {"model": "tiny", "prompt": "x"}, "stop"),
    ("/v1/completions", {"model": "tiny", "prompt": "x"}, "unknown_field"),
    ("/v1/chat/completions", CHAT, "tools"),
    ("/v1/chat/completions", CHAT, "messages"),
    ("/v1/embeddings", {"model": "tiny"}, "input"),
    (WAI, {"prompt": "x"}, "response_format"),
    ("/node/prefetch", {}, "model"),
]


@pytest.mark.parametrize(("path", "body", "field"), DEEP_CASES)
def test_deeply_nested_json_is_a_400_and_logs_no_traceback(
    node: LiveServer, caplog: pytest.LogCaptureFixture, path: str, body: dict, field: str
) -> None:
    caplog.set_level(logging.INFO)
    signed = router_trust.signed_headers(SECRET, "default", time.time()) if path == "/node/prefetch" else {}
    with httpx.Client(base_url=node.url, timeout=60) as client:
        deep = client.post(path, content=_with_field(body, field, nested(320)), headers={**JSON, **signed})
        assert deep.status_code == 400, deep.text
        assert f"nested deeper than {MAX_JSON_DEPTH} levels" in _error(deep, path)["message"]
        assert deep.headers["x-request-id"]
        after = client.get("/health")
        assert after.status_code == 200 and _connection(after) == _connection(deep)  # kept alive
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_nesting_up_to_the_limit_is_served(node: LiveServer) -> None:
    body = {"model": "tiny", "prompt": "x", "max_tokens": 1}

    def post(levels: int) -> int:  # the body itself is the first level
        content = _with_field(body, "x", nested(levels - 1))
        return httpx.post(node.url + "/v1/completions", content=content, headers=JSON).status_code

    assert (post(MAX_JSON_DEPTH), post(MAX_JSON_DEPTH + 1)) == (200, 400)


def test_a_body_that_is_not_utf8_is_a_400(node: LiveServer) -> None:
    r = httpx.post(node.url + WAI, content=b'{"prompt": "\xff\xfe"}', headers=JSON)
    assert r.status_code == 400 and "UTF-8" in _error(r, WAI)["message"]


@pytest.mark.parametrize("sig", ["é".encode(), b"\xff" * 64, "ab\xe9".encode("latin-1")])
def test_a_non_ascii_router_signature_is_a_401(node: LiveServer, sig: bytes) -> None:
    headers = {**router_trust.signed_headers(SECRET, "default", time.time()), router_trust.SIG_HEADER: sig}
    r = httpx.post(node.url + "/v1/chat/completions", json=CHAT, headers=headers)
    assert r.status_code == 401, r.text
    assert r.json()["error"]["type"] == "authentication_error"
    prefetch = httpx.post(node.url + "/node/prefetch", json={"model": "tiny"}, headers=headers)
    assert prefetch.status_code == 403, prefetch.text


@pytest.mark.parametrize("schema", [[1, 2], "object", None, 3, False])
@pytest.mark.parametrize("path", ["/v1/chat/completions", WAI])
def test_a_response_format_schema_must_be_a_schema(node: LiveServer, path: str, schema: object) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    body = {"prompt": "x", "max_tokens": 1} if path == WAI else CHAT
    r = httpx.post(node.url + path, json={**body, "response_format": fmt})
    assert r.status_code == 400, r.text
    assert "schema" in _error(r, path)["message"]


def test_schema_true_means_any_json_and_schema_text_is_depth_bounded(node: LiveServer) -> None:
    any_json = {"type": "json_schema", "json_schema": {"name": "x", "schema": True}}
    assert (
        httpx.post(node.url + "/v1/chat/completions", json={**CHAT, "response_format": any_json}).status_code
        == 200
    )
    as_text = {"type": "json_schema", "json_schema": nested(2000)}  # a schema sent as JSON text
    r = httpx.post(node.url + "/v1/chat/completions", json={**CHAT, "response_format": as_text})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"


@pytest.mark.parametrize("ids", [[2**70], [2**31], [-1], [5, 2**64]])
def test_stop_token_ids_are_32_bit(node: LiveServer, ids: list[int]) -> None:
    r = httpx.post(node.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "stop_token_ids": ids})
    assert r.status_code == 400, r.text
    error = _error(r, "/v1/completions")
    assert error["param"].startswith("stop_token_ids") and "2147483647" in error["message"]


def test_the_largest_stop_token_id_is_served(node: LiveServer) -> None:
    """Within the bound but outside the vocabulary: served, and never matches."""
    body = {"model": "tiny", "prompt": "x", "max_tokens": 1, "stop_token_ids": [2**31 - 1]}
    assert httpx.post(node.url + "/v1/completions", json=body).status_code == 200


@pytest.mark.parametrize(
    ("name", "value"), [("start", "nan"), ("end", "inf"), ("start", "-inf"), ("end", "1e400")]
)
def test_a_usage_window_must_be_finite(node: LiveServer, name: str, value: str) -> None:
    r = httpx.get(node.url + "/v1/usage", params={name: value})
    assert r.status_code == 400, r.text
    assert _error(r, "/v1/usage")["param"] == name
    assert httpx.get(node.url + "/v1/usage", params={name: "0"}).status_code == 200


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": "many"}, "max_tokens"),
        ("/v1/completions", {"model": "tiny", "prompt": "x", "top_p": 2}, "top_p"),
        (
            "/v1/chat/completions",
            {**CHAT, "messages": [{"role": "robot", "content": "x"}]},
            "messages.0.role",
        ),
        ("/v1/embeddings", {"model": "tiny", "input": "x", "dimensions": 0}, "dimensions"),
        (WAI, {"prompt": "x", "seed": -1}, None),
    ],
)
def test_validation_errors_are_400_naming_the_field(
    node: LiveServer, path: str, body: dict, param: str
) -> None:
    """OpenAI and vLLM answer type and bound errors with 400 (FastAPI's default is a 422)."""
    r = httpx.post(node.url + path, json=body)
    assert r.status_code == 400, r.text
    error = _error(r, path)
    if param is not None:
        assert error["param"] == param
    else:  # the Workers-AI envelope has no param: the message names the field
        assert error["message"].startswith("seed")


PARSER_REJECTS = [
    b"GET /health HTTP/1.1\r\nhost: t\r\nx-bad: a\x00b\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nhost: t\r\ncontent-length: -1\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nhost: t\r\ncontent-length: 2\r\ncontent-length: 3\r\n\r\n{}",
    b"GET /health HTTP/1.1\r\nhost: t\r\nbad name: x\r\n\r\n",
    b"GET /health\x00 HTTP/1.1\r\nhost: t\r\n\r\n",
]


@pytest.mark.parametrize("request_bytes", PARSER_REJECTS)
def test_what_the_http_parser_refuses_is_a_json_400_with_a_request_id(
    node: LiveServer, request_bytes: bytes
) -> None:
    assert_json_400(send_raw(node.port, request_bytes))
    assert httpx.get(node.url + "/health").status_code == 200


def test_ready_answers_503_draining_while_requests_finish(tmp_path, tiny_llama_dir: str) -> None:
    factory = NodeFactory(tmp_path)
    node = factory({"tiny": tiny_llama_dir}, preload=("tiny",))
    try:
        body = json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 2}).encode()
        head = (
            "POST /v1/completions HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n"
        )
        with socket.create_connection(("127.0.0.1", node.port), timeout=20) as sock:
            sock.sendall(head.encode() + body[:5])  # in flight: the rest of its body is yet to come
            _wait_for(lambda: node.requests_in_flight() == 1, "the request never started")
            node.ask_to_stop()  # what SIGTERM does
            ready = _wait_for(lambda: _draining(node), "/ready never answered draining")
            assert ready.json()["status"] == "draining"
            sock.sendall(body[5:])
            answer = sock.recv(65536)
        assert answer.startswith(b"HTTP/1.1 200"), answer
        _wait_for(lambda: not node.is_serving(), "the node did not stop once nothing was in flight")
        with pytest.raises(httpx.ConnectError):
            httpx.get(node.url + "/ready")
    finally:
        node.stop()


def _draining(node: LiveServer) -> httpx.Response | None:
    r = httpx.get(node.url + "/ready", headers={"connection": "close"})
    return r if r.status_code == 503 and r.json()["status"] == "draining" else None


def _wait_for(check, what: str, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while not (result := check()):
        assert time.monotonic() < deadline, what
        time.sleep(0.02)
    return result

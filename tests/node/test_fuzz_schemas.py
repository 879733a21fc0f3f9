"""Property-based fuzzing of requests against a live node, and against a router in front of it: whatever the
body and the headers hold, the answer is never a 5xx, the one keep-alive connection every case is sent on
stays open, the servers stay up, and no KV block is left behind.

Cases are the request schemas' bodies (valid ones, ones with a field replaced by junk, junk), then bent:
nested up to and past the depth limit, padded to just under, at and over the body limit, sent chunked, with
invalid UTF-8, escaped lone surrogates, NUL, a BOM or numbers JSON cannot hold spliced in, and with non-ASCII
bytes in the headers the servers read (request id, tenant signature, affinity, content type, ...). What no
client library sends (a NUL or a newline in a header, a bad Content-Length) goes over raw sockets: the HTTP
parser refuses it with a JSON 400 and closes that connection, and the kept one still serves.
"""

from __future__ import annotations

import itertools
import json
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from helpers.node_servers import LiveServer, NodeFactory
from helpers.router_fleet import RouterThread, one_node_fleet
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgeinfer.api import router_trust
from edgeinfer.api.limits import NodeLimits
from edgeinfer.router.config import RouterConfig
from edgeinfer.types.bounded_json import MAX_JSON_DEPTH

WAI = "/accounts/acct/ai/run/"

_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False, width=32),
    st.text(max_size=12),
    st.just("a\ud800"),  # a lone surrogate, valid in JSON text
)
_JUNK = st.recursive(
    _SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6,
)
# max_tokens is always there and small when it is a number, so valid examples generate only a few tokens.
_MAX_TOKENS = st.one_of(
    st.integers(min_value=-2, max_value=6),
    _SCALARS.filter(lambda v: not isinstance(v, int) or isinstance(v, bool)),
)
_SMALL = st.one_of(st.integers(min_value=-3, max_value=12), _SCALARS)
_FRACTION = st.one_of(st.floats(min_value=-1, max_value=12, allow_nan=False), _SCALARS)
_MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant", "tool", "x"])},
    optional={
        "content": st.one_of(
            st.text(max_size=12),
            st.just("a\udfff"),
            st.lists(
                st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]), "text": _SCALARS}),
                max_size=2,
            ),
            _SCALARS,
        )
    },
)
_MESSAGES = st.one_of(st.lists(_MESSAGE, max_size=3), _JUNK)
_PROMPT = st.one_of(
    st.text(max_size=16),
    st.lists(st.integers(min_value=-5, max_value=600), max_size=6),
    st.lists(st.text(max_size=6), max_size=3),
    _JUNK,
)
_SAMPLING = {
    "temperature": _FRACTION,
    "top_p": _FRACTION,
    "top_k": st.one_of(_SMALL, st.integers(min_value=-(2**65), max_value=2**65)),
    "min_p": _FRACTION,
    "n": _SMALL,
    "best_of": _SMALL,
    "seed": st.one_of(st.integers(min_value=-(2**65), max_value=2**65), _SCALARS),
    "stop": st.one_of(st.lists(st.text(max_size=3), max_size=3), _SCALARS),
    "stop_token_ids": st.one_of(st.lists(st.integers(min_value=-3, max_value=2**64), max_size=3), _SCALARS),
    "presence_penalty": _FRACTION,
    "frequency_penalty": _FRACTION,
    "repetition_penalty": _FRACTION,
    "min_tokens": _SMALL,
    "ignore_eos": _SCALARS,
    "stream": st.booleans(),
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.booleans()}), _SCALARS),
    "logit_bias": _JUNK,
    "response_format": st.one_of(
        st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object"])}), _SCALARS
    ),
    "tools": _JUNK,
    "options": st.one_of(st.fixed_dictionaries({"rejectIfBusy": _SCALARS}), _SCALARS),
}
_MODEL = st.sampled_from(["tiny", "@cf/test/tiny", "nope", ""])


# Valid bodies (each field in range), so that fuzzed requests also reach the engine and run there.
_VALID_SAMPLING = {
    "temperature": st.floats(min_value=0, max_value=2),
    "top_p": st.floats(min_value=0.05, max_value=1),
    "top_k": st.integers(min_value=-1, max_value=2**31 - 1),
    "min_p": st.floats(min_value=0, max_value=1),
    "n": st.integers(min_value=1, max_value=3),
    "seed": st.integers(min_value=0, max_value=2**64 - 1),
    "stop": st.lists(st.text(min_size=1, max_size=3), max_size=2),
    "presence_penalty": st.floats(min_value=-2, max_value=2),
    "frequency_penalty": st.floats(min_value=-2, max_value=2),
    "repetition_penalty": st.floats(min_value=0.5, max_value=2),
    "min_tokens": st.integers(min_value=0, max_value=2),
    "ignore_eos": st.booleans(),
    "stream": st.booleans(),
}
_VALID_TEXT = st.text(min_size=1, max_size=16)
_VALID_MESSAGES = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "user"]), "content": _VALID_TEXT}),
    min_size=1,
    max_size=2,
).map(lambda ms: [*ms, {"role": "user", "content": "hi"}])
_FEW_TOKENS = st.integers(min_value=1, max_value=6)


def _valid_bodies() -> st.SearchStrategy[tuple[str, dict[str, Any]]]:
    completion = st.fixed_dictionaries(
        {
            "model": st.just("tiny"),
            "prompt": st.one_of(_VALID_TEXT, st.lists(st.integers(3, 300), min_size=1, max_size=6)),
            "max_tokens": _FEW_TOKENS,
        },
        optional={**_VALID_SAMPLING, "echo": st.booleans(), "logprobs": st.integers(0, 5)},
    )
    chat = st.fixed_dictionaries(
        {"model": st.just("tiny"), "messages": _VALID_MESSAGES, "max_tokens": _FEW_TOKENS},
        optional={**_VALID_SAMPLING, "logprobs": st.just(True), "top_logprobs": st.integers(0, 5)},
    )
    workers_ai = st.fixed_dictionaries(
        {"prompt": _VALID_TEXT, "max_tokens": _FEW_TOKENS},
        optional={k: v for k, v in _VALID_SAMPLING.items() if k not in ("n", "min_p", "stop", "min_tokens")},
    )
    return st.one_of(
        st.tuples(st.just("/v1/completions"), completion),
        st.tuples(st.just("/v1/chat/completions"), chat),
        st.tuples(st.just(WAI + "tiny"), workers_ai),
    )


def _one_field_off(case: tuple[str, dict[str, Any]], key: str, value: Any) -> tuple[str, dict[str, Any]]:
    return case[0], {**case[1], key: value}


def _bodies() -> st.SearchStrategy[tuple[str, Any]]:
    """Valid bodies, valid bodies with one field replaced by junk, and bodies of junk."""
    completion = st.fixed_dictionaries(
        {"model": _MODEL, "prompt": _PROMPT, "max_tokens": _MAX_TOKENS},
        optional={**_SAMPLING, "echo": _SCALARS, "logprobs": _SMALL, "suffix": _SCALARS},
    )
    chat = st.fixed_dictionaries(
        {"model": _MODEL, "messages": _MESSAGES, "max_tokens": _MAX_TOKENS},
        optional={
            **_SAMPLING,
            "logprobs": _SCALARS,
            "top_logprobs": _SMALL,
            "max_completion_tokens": _MAX_TOKENS,
        },
    )
    workers_ai = st.fixed_dictionaries(
        {"max_tokens": _MAX_TOKENS},
        optional={**_SAMPLING, "prompt": _PROMPT, "messages": _MESSAGES, "raw": _SCALARS},
    )
    keys = st.sampled_from([*_SAMPLING, "prompt", "messages", "model", "echo", "logprobs", "top_logprobs"])
    return st.one_of(
        _valid_bodies(),
        st.builds(_one_field_off, _valid_bodies(), keys, st.one_of(_JUNK, _SMALL, _FRACTION)),
        st.tuples(st.just("/v1/completions"), completion),
        st.tuples(st.just("/v1/chat/completions"), chat),
        st.tuples(_MODEL.map(lambda m: WAI + (m or "tiny")), workers_ai),
        st.tuples(st.sampled_from(["/v1/completions", "/v1/chat/completions", WAI + "tiny"]), _JUNK),
    )


# A small body limit, so that cases reach it and pass it cheaply; the router enforces the node's.
BODY_LIMIT = 16 * 1024
SECRET = b"fuzz-router-secret-0123456789"
_SETTINGS: dict[str, Any] = {
    "deadline": None,
    "database": None,
    "derandomize": True,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large],
}


@dataclass
class Case:
    """One request: its body as sent (JSON or not), its headers, and whether the body goes chunked."""

    path: str
    body: bytes
    headers: dict[str, bytes] = field(default_factory=lambda: {"content-type": b"application/json"})
    chunked: bool = False


# One valid body per route (one token to generate), which the sweeps below bend one way at a time.
_BASES = [
    ("/v1/completions", {"model": "tiny", "prompt": "Hi", "max_tokens": 1}),
    (
        "/v1/chat/completions",
        {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1},
    ),
    (WAI + "tiny", {"prompt": "Hi", "max_tokens": 1}),
]
_PLACEHOLDER = "@@fuzz@@"
# Spliced in as a field's JSON text: nesting around the depth limit and far past it (the body itself is one
# level), strings holding what JSON text may carry but Unicode may not, and numbers no float holds.
_FRAGMENTS = [
    *(("[" * d + "]" * d).encode() for d in (MAX_JSON_DEPTH - 1, MAX_JSON_DEPTH, 320, 2000)),
    *(('{"a": ' * d + "1" + "}" * d).encode() for d in (MAX_JSON_DEPTH - 1, MAX_JSON_DEPTH, 320)),
    b'"a\xffb"',  # invalid UTF-8 inside a string
    b'"\xc3"',  # a truncated sequence
    b'"\xed\xa0\x80"',  # a surrogate encoded as UTF-8
    rb'"\ud800"',  # lone surrogates, escaped (valid JSON)
    rb'"\udfff\ud800x"',
    rb'"a\u0000b"',  # NUL, escaped (valid JSON)
    b'"a\x00b"',  # NUL, raw (invalid JSON)
    b"1e400",
    b"NaN",
    b"-Infinity",
    b"1" + b"0" * 40,
]
_FIELDS = ["prompt", "messages", "stop", "stop_token_ids", "max_tokens", "response_format", "tools", "x"]
_OFF_LIMIT = [-64, -1, 0, 1, 64, BODY_LIMIT]  # body sizes, in bytes from the body limit
_JUNK_BYTES = st.sampled_from([b"\xff", b"\xc0\xaf", b"\x00", b"\xef\xbb\xbf", rb"\ud800", b"\xe9", b"\r\n"])
_HEADER_NAMES = [
    "x-request-id",
    "authorization",
    "x-session-affinity",
    "x-client-location",
    "user-agent",
    *router_trust.TRUST_HEADERS,
]
_HEADER_VALUES = [b"\xff", "é".encode(), b"\xe9", "東京".encode(), b"\x7f\x80", b"a" * 300, b"nan", b"1e400"]
_CONTENT_TYPES = [
    b"application/json; charset=utf-8",
    b"application/json; charset=latin-1",
    b"application/vnd.api+json",
    b"text/plain",
    b"application/json; charset=\xff",
    "application/jsön".encode(),
]


def _spliced(path: str, body: dict[str, Any], name: str, fragment: bytes) -> Case:
    """`body` with field `name` (set or added) holding `fragment` as its JSON text."""
    text = json.dumps({**body, name: _PLACEHOLDER}).encode()
    return Case(path, text.replace(json.dumps(_PLACEHOLDER).encode(), fragment, 1))


def _sized(path: str, body: dict[str, Any], off_limit: int, chunked: bool) -> Case:
    """`body` padded with an unknown field to BODY_LIMIT + `off_limit` bytes."""
    bare = len(json.dumps({**body, "pad": ""}).encode())
    padded = json.dumps({**body, "pad": "x" * max(0, BODY_LIMIT + off_limit - bare)}).encode()
    return Case(path, padded, chunked=chunked)


def _sweep() -> Iterator[Case]:
    """Every fragment in two fields, every size around the limit (chunked or not), three odd values in
    every header the servers read (each value in several), every odd content type: each on one of the valid
    bodies, in turn."""
    bases = itertools.cycle(_BASES)
    fields = itertools.cycle(_FIELDS)
    for fragment in _FRAGMENTS:
        for _ in range(2):
            yield _spliced(*next(bases), next(fields), fragment)
    for off_limit in _OFF_LIMIT:
        for chunked in (False, True):
            yield _sized(*next(bases), off_limit, chunked)
    values = itertools.cycle(_HEADER_VALUES)
    for name in _HEADER_NAMES:
        for value in itertools.islice(values, 3):
            path, body = next(bases)
            yield Case(path, json.dumps(body).encode(), {"content-type": b"application/json", name: value})
    for content_type in _CONTENT_TYPES:
        path, body = next(bases)
        yield Case(path, json.dumps(body).encode(), {"content-type": content_type})


def _inserted(case: tuple[str, Any], at: int, junk: bytes, chunked: bool) -> Case:
    """`junk` bytes inserted anywhere in the body."""
    text = json.dumps(case[1]).encode()
    at %= len(text) + 1
    return Case(case[0], text[:at] + junk + text[at:], chunked=chunked)


def _plain(case: tuple[str, Any]) -> Case:
    return Case(case[0], json.dumps(case[1]).encode())


def _connection(r: httpx.Response) -> object:
    """The client end of the connection that carried `r`: a new one means the server dropped the last."""
    return r.extensions["network_stream"].get_extra_info("client_addr")


def _send(client: httpx.Client, case: Case) -> httpx.Response:
    content: bytes | Iterator[bytes] = iter([case.body]) if case.chunked else case.body
    return client.post(case.path, content=content, headers=case.headers)


def _check(client: httpx.Client, connection: object, case: Case) -> None:
    r = _send(client, case)
    where = (case.path, case.body[:200], case.headers, case.chunked)
    assert r.status_code < 500, (*where, r.status_code, r.text[:500])
    assert r.headers.get("connection") != "close" and _connection(r) == connection, ("dropped", *where)
    assert r.headers["x-request-id"]
    if r.status_code >= 400:
        answer = r.json()
        assert "errors" in answer if case.path.startswith("/accounts/") else "error" in answer


def _fuzz(cases: st.SearchStrategy[Case], max_examples: int) -> Callable[[httpx.Client, object], None]:
    @settings(max_examples=max_examples, **_SETTINGS)
    @given(case=cases)
    def check(client: httpx.Client, connection: object, case: Case) -> None:
        _check(client, connection, case)

    return check


# What the HTTP parser refuses, and its neighbours it reads: one header line (after `connection: close`,
# which the server then honours), and a body of 2 bytes under a Content-Length that is 2 or no number.
_RAW_NAMES = st.sampled_from([b"x-a", b"bad name", b"x\xff", b"x-a\x00", b"", b":", b"content-length"])
_RAW_VALUES = st.one_of(
    st.sampled_from(
        [b"a\x00b", b"a\rb", b"a\nb", b"\x0b", b"\xff\xfe", "東".encode(), b" 2", b"-1", b"2, 3"]
    ),
    st.binary(max_size=6).filter(lambda b: b"\r\n\r\n" not in b),
)
_CONTENT_LENGTHS = st.sampled_from([b"2", b"02", b"-1", b"abc", b"+2", b"0x2", b"2, 3", b"2 2", b""])


def _raw_request(method: bytes, name: bytes, value: bytes, content_length: bytes) -> bytes:
    lines = [method + b" /health HTTP/1.1", b"host: fuzz", b"connection: close", name + b": " + value]
    if method == b"POST":
        lines.append(b"content-length: " + content_length)
    return b"\r\n".join(lines) + b"\r\n\r\n" + (b"{}" if method == b"POST" else b"")


def _raw_answer(port: int, request: bytes) -> bytes:
    """The server's whole answer to `request` on a connection of its own (it closes it: `connection: close`,
    or the parser refused the request)."""
    with socket.create_connection(("127.0.0.1", port), timeout=15) as sock:
        sock.sendall(request)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


@settings(max_examples=40, **_SETTINGS)
@given(
    request=st.builds(
        _raw_request, st.sampled_from([b"GET", b"POST"]), _RAW_NAMES, _RAW_VALUES, _CONTENT_LENGTHS
    )
)
def _check_raw(port: int, request: bytes) -> None:
    answer = _raw_answer(port, request)
    head = answer.partition(b"\r\n\r\n")[0].lower()
    status = int(head.split(b" ", 2)[1])
    assert status < 500 and b"\r\nx-request-id: " in head, (request, answer[:300])
    assert b"\r\ncontent-type: application/json" in head, (request, answer[:300])


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: str) -> Iterator[LiveServer]:
    """The tiny model preloaded, a router's secret (so signed tenant headers are checked), a small body
    limit; loopback is a trusted proxy, as the router's address (its connections are not bounded)."""
    factory = NodeFactory(tmp_path_factory.mktemp("fuzz-node"))
    server = factory(
        {"tiny": tiny_llama_dir},
        aliases={"tiny": ("@cf/test/tiny",)},
        preload=("tiny",),
        router_secret=SECRET,
        node_id="fuzz-1",
        location="FRA",
        trusted_proxies=("127.0.0.1",),
        max_body_bytes=BODY_LIMIT,
    )
    yield server
    server.stop()


@pytest.fixture(scope="module")
def router(node: LiveServer) -> Iterator[RouterThread]:
    limits = NodeLimits(max_body_bytes=BODY_LIMIT)
    config = RouterConfig(location="FRA", router_secret=SECRET, placement=None, seed=0, limits=limits)
    server = RouterThread(config, one_node_fleet("fuzz-1", node.url)).start()
    server.wait_for_nodes({"fuzz-1"})
    yield server
    server.stop()


@pytest.mark.parametrize(("target", "bodies"), [("node", 100), ("router", 50)])
def test_fuzzed_requests_get_no_5xx_keep_the_connection_and_leak_nothing(
    node: LiveServer, router: RouterThread, target: str, bodies: int
) -> None:
    url = node.url if target == "node" else router.url
    one = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    with httpx.Client(base_url=url, timeout=60, limits=one) as client:
        connection = _connection(client.get("/health"))
        for case in _sweep():
            _check(client, connection, case)
        _fuzz(_bodies().map(_plain), bodies)(client, connection)
        junk = st.builds(_inserted, _bodies(), st.integers(0, 10_000), _JUNK_BYTES, st.booleans())
        _fuzz(junk, 30)(client, connection)
        _check_raw(int(url.rsplit(":", 1)[1]))
        after = client.get("/health")
        assert after.status_code == 200 and _connection(after) == connection
    node.wait_idle("tiny")
    node.engine("tiny").check_integrity()
    assert node.engine("tiny").stats().kv_usage == 0.0

"""Tenants' caches through the HTTP path: isolation, client-sent salts ignored, salts to upstreams."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar

import httpx
import pytest

from edgeinfer.bench.audit_cache import audit, ttft

KEY_A, KEY_B = "ei-key-a", "ei-key-b"
PROMPT = "the quick brown fox jumps over the lazy dog " * 6


def _complete(url: str, key: str, model: str = "tiny", **extra: Any) -> dict[str, Any]:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 5, "temperature": 0, **extra}
    r = httpx.post(url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200, r.text
    return r.json()


def _cached(answer: dict[str, Any]) -> int:
    return (answer["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)


@pytest.fixture
def two_tenants(node_factory, make_tenant, tiny_llama_dir):
    tenants = [make_tenant("alpha", KEY_A), make_tenant("beta", KEY_B)]
    return node_factory({"tiny": tiny_llama_dir}, tenants=tenants, preload=("tiny",))


def test_client_salt_and_tenant_header_change_nothing(two_tenants) -> None:
    url = two_tenants.url
    first = _complete(url, KEY_A)
    mine = _complete(url, KEY_A, cache_salt="something-else")  # A's own salt is the server's, still
    assert _cached(first) == 0 and _cached(mine) > 0
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 5, "temperature": 0, "cache_salt": "x"}
    forged = {
        "Authorization": f"Bearer {KEY_B}",
        "x-edgeinfer-tenant": "alpha",
        "x-edgeinfer-cache-salt": "x",
    }
    other = httpx.post(url + "/v1/completions", json=body, headers=forged).json()
    assert _cached(other) == 0  # B cannot reach A's blocks by naming A or a salt
    assert other["choices"][0]["text"] == first["choices"][0]["text"]  # same greedy text, computed anew
    metrics = httpx.get(url + "/metrics").text
    assert 'edgeinfer:tenant_cached_blocks{model="tiny",tenant="alpha"}' in metrics
    assert 'tenant="beta"' in metrics


class _Recorder(BaseHTTPRequestHandler):
    """A stand-in upstream engine (a real server on loopback) that records the bodies it receives."""

    bodies: ClassVar[list[dict[str, Any]]] = []

    def do_GET(self) -> None:
        self._send({"object": "list", "data": [{"id": "inner", "object": "model"}]})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.bodies.append(body)
        usage = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
        choices = [{"index": 0, "text": "ok", "finish_reason": "stop"}]
        self._send({"id": "x", "object": "text_completion", "choices": choices, "usage": usage})

    def _send(self, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def recorder() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_an_upstream_member_receives_the_tenants_salt(recorder, node_factory, make_tenant) -> None:
    tenants = [make_tenant("alpha", KEY_A), make_tenant("beta", KEY_B)]
    node = node_factory({}, upstreams={"far": recorder + "/v1"}, tenants=tenants)
    _Recorder.bodies.clear()
    _complete(node.url, KEY_A, model="far", cache_salt="client-chosen")
    _complete(node.url, KEY_B, model="far")
    salt_a, salt_b = (b["cache_salt"] for b in _Recorder.bodies)
    registry = node.service.tenants  # each tenant's server-derived salt
    assert (
        salt_a == registry.by_name("alpha").cache_namespace
        and salt_b == registry.by_name("beta").cache_namespace
    )
    assert salt_a != salt_b and len(salt_a) == 64


def test_audit_cache_runs_against_a_node(two_tenants) -> None:
    """The audit's measurement plumbing on a real server (its verdicts live in docs/benchmarks.md)."""
    result = asyncio.run(audit(two_tenants.url, KEY_A, KEY_B, "tiny", n=4, words=40, seed=3))
    assert len(result.same_tenant_ttft_s) == len(result.other_tenant_ttft_s) == len(result.unseen_ttft_s) == 4
    assert all(t > 0 for t in result.unseen_ttft_s)
    assert 0.0 <= result.auc_other_vs_unseen <= 1.0 and 0.0 <= result.ks_same_vs_unseen[1] <= 1.0
    stats = two_tenants.engine("tiny").stats()
    assert stats.prefix_cache_hits > 0  # A's repeats hit; B's never can (test above)


def test_ttft_bucket_holds_every_first_token(node_factory, make_tenant, tiny_llama_dir) -> None:
    node = node_factory(
        {"tiny": tiny_llama_dir},
        tenants=[make_tenant("alpha", KEY_A)],
        preload=("tiny",),
        ttft_bucket_ms=1500,
    )

    async def probe() -> list[float]:
        async with httpx.AsyncClient(base_url=node.url, timeout=60) as client:
            return [await ttft(client, "tiny", KEY_A, PROMPT) for _ in range(2)]

    miss, hit = asyncio.run(probe())
    # the miss and the hit (its repeat) both wait for the end of the first bucket: one can't tell them apart
    assert 1.5 <= miss < 3.0 and 1.5 <= hit < 3.0


def test_public_prefixes_flag_shares_a_prefix_and_keeps_tails_private(tmp_path, tiny_llama_dir) -> None:
    """`serve --public-prefixes FILE` end to end: both tenants hit the declared prefix on their first
    request; a tenant's tail after it is hit by that tenant alone."""
    from helpers.node_servers import NodeProcesses

    from edgeinfer.api.keys import hash_key

    public = "You are a careful assistant who answers briefly. " * 8
    tenants = tmp_path / "tenants.json"
    tenants.write_text(
        json.dumps(
            {"tenants": [{"name": n, "key_sha256": hash_key(k)} for n, k in (("a", KEY_A), ("b", KEY_B))]}
        )
    )
    prefixes = tmp_path / "public.json"
    prefixes.write_text(json.dumps({"tiny": {"texts": [public]}}))
    procs = NodeProcesses(tmp_path)
    try:
        url = procs.start(
            "--model", f"tiny={tiny_llama_dir}", "--preload", "--dtype", "float32", "--tenants", str(tenants),
            "--public-prefixes", str(prefixes), "--batch-window-ms", "0",
        )  # fmt: skip

        def ask(key: str, tail: str) -> dict[str, Any]:
            body = {"model": "tiny", "prompt": public + tail, "max_tokens": 3, "temperature": 0}
            r = httpx.post(url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 200, r.text
            return r.json()

        tail = "Question from a: what is the tallest mountain on the moon, and who first climbed it? " * 2
        first_a, first_b = ask(KEY_A, tail), ask(KEY_B, "Question from b: hello there")
        shared = _cached(first_a)
        assert shared > 0 and _cached(first_b) == shared  # the public prefix, for both, on first visit
        again_b = ask(KEY_B, tail)  # a's whole prompt: b reaches the public part only
        assert _cached(again_b) == shared
        assert again_b["choices"][0]["text"] == first_a["choices"][0]["text"]
        assert _cached(ask(KEY_A, tail)) > shared  # a's own tail is a's
    finally:
        procs.stop()

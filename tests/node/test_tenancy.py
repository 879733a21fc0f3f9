"""Keys, per-key limits, metering and metrics, against a real node."""

from __future__ import annotations

import sqlite3

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

KEY_A, KEY_B = "ei-key-a", "ei-key-b"


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _metrics(node) -> dict[tuple[str, tuple], float]:
    text = httpx.get(node.url + "/metrics").text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _value(metrics: dict, name: str, **labels: str) -> float:
    return metrics.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.fixture
def keyed_node(node_factory, make_tenant, tiny_llama_dir):
    return node_factory(
        {"tiny": tiny_llama_dir},
        tenants=[make_tenant("alpha", KEY_A, requests_per_minute=5), make_tenant("beta", KEY_B)],
        preload=("tiny",),
    )


def test_keys_are_checked(keyed_node) -> None:
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 1}
    wrong = httpx.post(keyed_node.url + "/v1/completions", json=body, headers=_auth("ei-wrong"))
    assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
    missing = httpx.post(keyed_node.url + "/v1/completions", json=body)
    assert missing.status_code == 401 and "Bearer" in missing.json()["error"]["message"]
    # auth comes before body validation: a bad body with a bad key is still a 401
    assert httpx.post(keyed_node.url + "/v1/completions", json={"x": 1}).status_code == 401
    wai = httpx.post(keyed_node.url + "/accounts/a/ai/run/tiny", json={"prompt": "x"}, headers=_auth("nope"))
    assert wai.status_code == 401 and wai.json()["errors"][0]["code"] == 10000
    client = openai.OpenAI(base_url=keyed_node.url + "/v1", api_key="ei-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.models.list()
    assert httpx.post(keyed_node.url + "/v1/completions", json=body, headers=_auth(KEY_B)).status_code == 200


def test_requests_per_minute_is_exact_with_retry_after(keyed_node) -> None:
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 1}
    statuses, retry_after = [], None
    for _ in range(8):
        r = httpx.post(keyed_node.url + "/v1/completions", json=body, headers=_auth(KEY_A))
        statuses.append(r.status_code)
        if r.status_code == 429:
            retry_after = int(r.headers["Retry-After"])
            assert r.json()["error"]["type"] == "rate_limit_error"
    assert statuses == [200] * 5 + [429] * 3
    assert retry_after is not None and 1 <= retry_after <= 60
    # another key has its own window
    assert httpx.post(keyed_node.url + "/v1/completions", json=body, headers=_auth(KEY_B)).status_code == 200


def test_tokens_per_minute_counts_reservations(node_factory, make_tenant, tiny_llama_dir) -> None:
    node = node_factory({"tiny": tiny_llama_dir}, tenants=[make_tenant("t", KEY_A, tokens_per_minute=40)])
    ids = list(range(3, 13))  # a 10-token prompt: each request reserves 10 + max_tokens
    ok = [
        httpx.post(
            node.url + "/v1/completions",
            json={"model": "tiny", "prompt": ids, "max_tokens": 5, "ignore_eos": True},
            headers=_auth(KEY_A),
        ).status_code
        for _ in range(4)
    ]
    assert ok == [200, 200, 429, 429]  # 15 + 15 = 30 used; a third would need 45 > 40
    too_big = httpx.post(
        node.url + "/v1/completions",
        json={"model": "tiny", "prompt": ids, "max_tokens": 50},
        headers=_auth(KEY_A),
    )
    assert too_big.status_code == 400 and "tokens per minute" in too_big.json()["error"]["message"]


def test_usage_store_matches_token_counts(keyed_node) -> None:
    seen = []
    for prompt in ("Hello there", "The quick brown fox"):
        r = httpx.post(
            keyed_node.url + "/v1/completions",
            json={"model": "tiny", "prompt": prompt, "max_tokens": 3},
            headers=_auth(KEY_B),
        )
        seen.append(r.json()["usage"])
    stream = httpx.post(
        keyed_node.url + "/accounts/x/ai/run/tiny",
        json={"prompt": "Hi", "max_tokens": 2, "stream": True},
        headers=_auth(KEY_B),
    )
    assert stream.status_code == 200
    usage = httpx.get(keyed_node.url + "/v1/usage", headers=_auth(KEY_B)).json()
    assert usage["tenant"] == "beta"
    total = usage["total"]
    assert total["requests"] == 3
    assert total["input_tokens"] >= sum(u["prompt_tokens"] for u in seen)
    assert total["output_tokens"] == sum(u["completion_tokens"] for u in seen) + 2
    assert total["cost_units"] > 0
    # the other tenant sees only its own rows
    assert httpx.get(keyed_node.url + "/v1/usage", headers=_auth(KEY_A)).json()["total"]["requests"] == 0
    db = keyed_node.service.store
    rows = db.records("beta")
    assert [r.output_tokens for r in reversed(rows[1:])] == [u["completion_tokens"] for u in seen]
    with pytest.raises(sqlite3.DatabaseError, match="append-only"):
        db._conn.execute("DELETE FROM usage")


def test_metrics_move(shared_node) -> None:
    before = _metrics(shared_node)
    r = httpx.post(
        shared_node.url + "/v1/completions",
        json={"model": "tiny", "prompt": "Hi", "max_tokens": 3, "ignore_eos": True},
    )
    assert r.status_code == 200
    httpx.post(shared_node.url + "/v1/completions", json={"model": "nope", "prompt": "Hi"})
    after = _metrics(shared_node)
    usage = r.json()["usage"]

    def delta(name: str, **labels: str) -> float:
        return _value(after, name, **labels) - _value(before, name, **labels)

    assert delta("edgeinfer:generation_tokens_total", model="tiny") == 3
    assert delta("edgeinfer:prompt_tokens_total", model="tiny") == usage["prompt_tokens"]
    assert delta("edgeinfer:request_outcomes_total", model="tiny", code="200") == 1
    assert delta("edgeinfer:request_outcomes_total", model="-", code="404") == 1
    for name in (
        "time_to_first_token_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
        "request_prefill_time_seconds",
        "request_decode_time_seconds",
    ):
        assert delta(f"edgeinfer:{name}_count", model="tiny") == 1, name
    assert delta("edgeinfer:inter_token_latency_seconds_count", model="tiny") == 2
    assert _value(after, "edgeinfer:num_requests_running", model="tiny") == 0
    assert 0.0 <= _value(after, "edgeinfer:kv_cache_usage_perc", model="tiny") <= 1.0
    assert ("edgeinfer:prefix_cache_queries_total", (("model", "tiny"),)) in after
    assert _value(after, "edgeinfer:model_loads_total", model="tiny") == 1
    assert _value(after, "process_resident_memory_bytes") > 0


def test_prefix_cache_is_namespaced_per_tenant(keyed_node) -> None:
    prompt = list(range(10, 40))  # 30 tokens: several full KV blocks

    def cached(key: str) -> int:
        r = httpx.post(
            keyed_node.url + "/v1/completions",
            json={"model": "tiny", "prompt": prompt, "max_tokens": 1},
            headers=_auth(key),
        )
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached(KEY_B) == 0
    assert cached(KEY_B) >= 24  # the same tenant reuses its blocks
    assert cached(KEY_A) == 0  # another tenant never hits them
    keyed_node.service.store.flush()
    rows = {r.cached_input_tokens for r in keyed_node.service.store.records("beta")}
    assert max(rows) >= 24  # metered as cached input (billed at the discounted price)

"""The warm pool behind a real node: eviction under a budget, one load for concurrent requests, upstreams."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai


def _complete(node, model: str, **extra) -> httpx.Response:
    body = {"model": model, "prompt": "Hello", "max_tokens": 2, **extra}
    return httpx.post(node.url + "/v1/completions", json=body, timeout=60)


def _states(node) -> dict[str, str]:
    models = httpx.get(node.url + "/v1/models").json()["data"]
    return {m["id"]: m["edgeinfer"]["state"] for m in models}


def _counter(node, name: str, model: str) -> float:
    for line in httpx.get(node.url + "/metrics").text.splitlines():
        if line.startswith(f'{name}{{model="{model}"}}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_idle_model_is_evicted_and_reloads_on_demand(node_factory, tiny_llama_dir, tiny_llama_b_dir) -> None:
    probe = node_factory({"a": tiny_llama_dir}, preload=("a",))
    one_model = probe.service.pool.residents()["a"].memory_bytes()
    # room for one model and a half: loading the second must evict the first
    node = node_factory({"a": tiny_llama_dir, "b": tiny_llama_b_dir}, budget=one_model * 3 // 2)
    assert _states(node) == {"a": "unloaded", "b": "unloaded"}
    assert _complete(node, "a").status_code == 200
    assert _states(node) == {"a": "resident", "b": "unloaded"}
    assert _complete(node, "b").status_code == 200
    assert _states(node) == {"a": "unloaded", "b": "resident"}
    assert _counter(node, "edgeinfer:model_evictions_total", "a") == 1
    assert _complete(node, "a").status_code == 200  # reloaded on demand
    assert _states(node) == {"a": "resident", "b": "unloaded"}
    assert _counter(node, "edgeinfer:model_loads_total", "a") == 2
    assert node.service.pool.used_bytes() <= node.service.pool.budget_bytes


def test_concurrent_requests_share_one_load(node_factory, tiny_llama_dir) -> None:
    node = node_factory({"lazy": tiny_llama_dir})

    async def main() -> list[int]:
        async with httpx.AsyncClient(base_url=node.url, timeout=60) as client:
            body = {"model": "lazy", "prompt": "Hi", "max_tokens": 2}
            responses = await asyncio.gather(*[client.post("/v1/completions", json=body) for _ in range(5)])
            return [r.status_code for r in responses]

    assert asyncio.run(main()) == [200] * 5
    assert _counter(node, "edgeinfer:model_loads_total", "lazy") == 1


def test_model_too_big_for_the_budget_is_503(node_factory, tiny_llama_dir) -> None:
    node = node_factory({"tiny": tiny_llama_dir}, budget=1000)
    r = _complete(node, "tiny")
    assert r.status_code == 503 and "budget" in r.json()["error"]["message"]


def test_upstream_member_served_by_another_edgeinfer(upstream_node, node_factory) -> None:
    upstream_url = upstream_node
    node = node_factory({}, upstreams={"@cf/big/model": upstream_url + "/v1"})
    client = openai.OpenAI(base_url=node.url + "/v1", api_key="unused", max_retries=0)
    direct = openai.OpenAI(base_url=upstream_url + "/v1", api_key="unused", max_retries=0)
    kwargs = dict(prompt="The quick brown fox", max_tokens=5, temperature=0)
    via_node = client.completions.create(model="@cf/big/model", **kwargs)
    reference = direct.completions.create(model="inner", **kwargs)
    assert via_node.choices[0].text == reference.choices[0].text
    assert via_node.model == "@cf/big/model"
    assert via_node.usage.prompt_tokens == reference.usage.prompt_tokens

    stream = client.chat.completions.create(
        model="@cf/big/model",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        temperature=0,
        stream=True,
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    whole = direct.chat.completions.create(
        model="inner", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0
    )
    assert streamed == whole.choices[0].message.content

    wai = httpx.post(node.url + "/accounts/x/ai/run/@cf/big/model", json={"prompt": "Hi", "max_tokens": 3})
    assert wai.status_code == 200 and wai.json()["result"]["usage"]["completion_tokens"] >= 1

    # metering and metrics come from the upstream's usage, under the node's model name
    usage = httpx.get(node.url + "/v1/usage").json()
    assert usage["total"]["requests"] == 3
    assert usage["total"]["output_tokens"] == (
        via_node.usage.completion_tokens
        + whole.usage.completion_tokens
        + wai.json()["result"]["usage"]["completion_tokens"]
    )
    assert (
        _counter(node, "edgeinfer:generation_tokens_total", "@cf/big/model")
        == usage["total"]["output_tokens"]
    )
    bad = httpx.post(
        node.url + "/v1/completions", json={"model": "@cf/big/model", "prompt": "x", "max_tokens": 9999}
    )
    assert bad.status_code == 400  # the upstream's client error keeps its status


def _upstream_usage(url: str) -> dict:
    return httpx.get(url + "/v1/usage").json()["total"]


def _wait(predicate, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


def test_disconnect_through_the_node_aborts_the_upstream(upstream_node, node_factory) -> None:
    upstream_url = upstream_node
    before = _upstream_usage(upstream_url)
    node = node_factory({}, upstreams={"big": upstream_url})
    body = {"model": "big", "prompt": "Hello", "max_tokens": 480, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", node.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert any(next(lines).startswith("data: ") for _ in range(4))
    # the node closed its upstream stream, so the upstream aborted and metered a partial request
    _wait(lambda: _upstream_usage(upstream_url)["requests"] == before["requests"] + 1)
    assert _upstream_usage(upstream_url)["output_tokens"] - before["output_tokens"] < 480
    running = [
        line
        for line in httpx.get(upstream_url + "/metrics").text.splitlines()
        if line.startswith('edgeinfer:num_requests_running{model="inner"}')
    ]
    assert running == ['edgeinfer:num_requests_running{model="inner"} 0.0']
    node_usage = httpx.get(node.url + "/v1/usage").json()["total"]
    assert node_usage["requests"] == 1 and 0 < node_usage["output_tokens"] < 480  # estimated from chunks

"""Disconnects, slow readers and poisoned requests: the node frees what it holds and others go on."""

from __future__ import annotations

import asyncio
import json
import math
import shutil
import time
from pathlib import Path

import httpx
import pytest
from safetensors.torch import load_file, save_file

NAN_TOKEN = 7  # its embedding row is NaN in the broken model


def _long_stream_body(**extra) -> dict:
    return {
        "model": "tiny",
        "prompt": "Hello",
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
        **extra,
    }


def _wait_for_record(node, request_count: int, timeout: float = 10.0) -> list:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        node.service.store.flush()
        rows = node.service.store.records("default")
        if len(rows) >= request_count:
            return rows
        time.sleep(0.05)
    raise AssertionError("usage record not written")


def test_disconnect_mid_stream_frees_every_block(node_factory, tiny_llama_dir) -> None:
    node = node_factory({"tiny": tiny_llama_dir}, preload=("tiny",))
    with httpx.stream("POST", node.url + "/v1/completions", json=_long_stream_body()) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        received = [next(lines) for _ in range(6)]  # a few events, then hang up
    assert any(line.startswith("data: ") for line in received)
    node.wait_idle("tiny")
    engine = node.engine("tiny")
    engine.check_integrity()
    stats = engine.stats()
    assert stats.num_running == 0 and stats.kv_usage == 0.0
    record = _wait_for_record(node, 1)[0]
    assert record.status == 499
    assert 0 < record.output_tokens < 400  # billed for what was generated before the hang-up


def test_disconnect_before_non_streamed_answer_aborts(node_factory, tiny_llama_dir) -> None:
    node = node_factory({"tiny": tiny_llama_dir}, preload=("tiny",))
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 480, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(node.url + "/v1/completions", json=body, timeout=httpx.Timeout(5.0, read=0.3))
    record = _wait_for_record(node, 1)[0]
    assert record.status == 499 and record.output_tokens < 480
    node.wait_idle("tiny")
    node.engine("tiny").check_integrity()


def test_slow_reader_does_not_hold_up_others(shared_node) -> None:
    async def main() -> tuple[str, list[int], str]:
        async with httpx.AsyncClient(base_url=shared_node.url, timeout=60) as client:
            body = {
                "model": "tiny",
                "prompt": "Edge",
                "max_tokens": 120,
                "temperature": 0,
                "ignore_eos": True,
            }
            async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as slow:
                # while the slow stream is not being read, other requests complete
                others = await asyncio.gather(
                    *[client.post("/v1/completions", json={**body, "max_tokens": 4}) for _ in range(3)]
                )
                pieces = []
                async for line in slow.aiter_lines():
                    if line.startswith("data: {"):
                        pieces.append(json.loads(line[6:])["choices"][0]["text"])
            whole = (await client.post("/v1/completions", json=body)).json()["choices"][0]["text"]
            return "".join(pieces), [o.status_code for o in others], whole

    streamed, statuses, whole = asyncio.run(main())
    assert statuses == [200, 200, 200]
    assert streamed == whole


@pytest.fixture(scope="module")
def broken_model_dir(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny model with one NaN embedding row and an all-zero LM head (every logit equal)."""
    path = tmp_path_factory.mktemp("broken") / "broken"
    shutil.copytree(tiny_llama_dir, path)
    weights_file = next(Path(path).glob("*.safetensors"))
    tensors = load_file(weights_file)
    tensors["model.embed_tokens.weight"][NAN_TOKEN] = math.nan
    tensors["lm_head.weight"].zero_()
    save_file(tensors, weights_file, metadata={"format": "pt"})
    return str(path)


def _canary(metrics: str, node, kind: str) -> float:
    version = node.service.pool.residents()["broken"].version
    prefix = f'edgeinfer:canary_events_total{{kind="{kind}",model="broken",version="{version}"}} '
    return next((float(line[len(prefix) :]) for line in metrics.splitlines() if line.startswith(prefix)), 0.0)


GOOD = {"model": "broken", "prompt": [3, 4, 5], "max_tokens": 40, "ignore_eos": True, "temperature": 0}
POISONED = {**GOOD, "prompt": [3, NAN_TOKEN, 5]}


def test_nan_request_gets_500_and_canaries_count(node_factory, broken_model_dir) -> None:
    node = node_factory({"broken": broken_model_dir}, preload=("broken",))
    poisoned = httpx.post(node.url + "/v1/completions", json=POISONED, timeout=60)
    assert poisoned.status_code == 500 and "NaN" in poisoned.json()["error"]["message"]
    good = httpx.post(node.url + "/v1/completions", json=GOOD, timeout=60)
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 40
    metrics = httpx.get(node.url + "/metrics").text
    assert _canary(metrics, node, "nonfinite_logits") == 1
    # equal logits make greedy decoding repeat one token: the repetition canary flags the good request
    assert _canary(metrics, node, "degenerate_repetition") == 1
    assert 'edgeinfer:request_outcomes_total{code="500",model="broken"} 1.0' in metrics
    node.wait_idle("broken")
    node.engine("broken").check_integrity()


def test_nan_request_fails_alone_among_concurrent_ones(node_factory, broken_model_dir) -> None:
    node = node_factory({"broken": broken_model_dir}, preload=("broken",))

    async def main() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=node.url, timeout=60) as client:
            bodies = [POISONED, GOOD, GOOD, GOOD]  # all in flight together, so they share engine steps
            return list(await asyncio.gather(*[client.post("/v1/completions", json=b) for b in bodies]))

    poisoned, *good = asyncio.run(main())
    assert poisoned.status_code == 500
    assert [r.status_code for r in good] == [200, 200, 200], [r.text for r in good]

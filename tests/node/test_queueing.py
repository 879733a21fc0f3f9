"""Queue-depth limit and rejectIfBusy on a busy resident model; the JSON access log."""

from __future__ import annotations

import asyncio
import json
import logging
import time

import httpx

from edgeinfer.engine.config import EngineConfig
from edgeinfer.obs.access_log import ACCESS_LOGGER

ONE_AT_A_TIME = EngineConfig(
    dtype="float32", batch_window_ms=0, block_size=4, kv_cache_memory_bytes=256 * 1024, max_num_seqs=1
)
LONG = {"model": "tiny", "prompt": "Hello", "max_tokens": 480, "ignore_eos": True}


def _wait_until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def test_full_queue_and_reject_if_busy_answer_429_3040(node_factory, tiny_llama_dir) -> None:
    node = node_factory({"tiny": tiny_llama_dir}, preload=("tiny",), engine=ONE_AT_A_TIME, max_queue_depth=1)
    engine = node.engine("tiny")

    async def main() -> tuple[httpx.Response, httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(base_url=node.url, timeout=60) as client:
            running = asyncio.create_task(client.post("/v1/completions", json=LONG))
            await asyncio.to_thread(_wait_until, lambda: engine.stats().num_running == 1)
            waiting = asyncio.create_task(client.post("/v1/completions", json=LONG))
            await asyncio.to_thread(_wait_until, lambda: engine.stats().num_waiting == 1)
            full = await client.post("/v1/completions", json={**LONG, "max_tokens": 1})
            busy = await client.post(
                "/accounts/a/ai/run/tiny",
                json={"prompt": "x", "max_tokens": 1, "options": {"rejectIfBusy": True}},
            )
            for task in (running, waiting):
                task.cancel()
            return full, busy, await client.get("/health")

    full, busy, health = asyncio.run(main())
    assert full.status_code == 429 and full.json()["error"]["code"] == "3040"
    assert "queue is full" in full.json()["error"]["message"] and full.headers["Retry-After"] == "1"
    assert busy.status_code == 429 and busy.json()["errors"][0]["code"] == 3040
    assert health.json() == {"status": "ok"}
    node.wait_idle("tiny", timeout=30)  # the cancelled clients' requests were aborted...
    engine.check_integrity()
    store = node.service.store

    def both_metered() -> bool:
        store.flush()
        return len(store.records("default")) == 2

    _wait_until(both_metered, timeout=30)
    # ...not run to the end: both are metered as client-closed with fewer tokens than asked for
    assert {(r.status, r.output_tokens < LONG["max_tokens"]) for r in store.records("default")} == {
        (499, True)
    }


def test_access_log_lines(node_factory, tiny_llama_dir, caplog) -> None:
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    node = node_factory({"tiny": tiny_llama_dir}, preload=("tiny",))
    httpx.post(
        node.url + "/v1/completions",
        json={"model": "tiny", "prompt": "Hi", "max_tokens": 2},
        headers={"x-session-affinity": "s1"},
    )
    httpx.post(
        node.url + "/v1/chat/completions",
        json={
            "model": "tiny",
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 2,
            "stream": True,
        },
    )
    ready = httpx.get(node.url + "/ready")
    assert ready.status_code == 200 and ready.json()["resident_models"] == ["tiny"]
    _wait_until(lambda: sum(r.name == ACCESS_LOGGER for r in caplog.records) >= 3)
    lines = [json.loads(r.message) for r in caplog.records if r.name == ACCESS_LOGGER]
    plain, streamed = lines[0], lines[1]
    assert plain["path"] == "/v1/completions" and plain["status"] == 200 and plain["tenant"] == "default"
    assert plain["model"] == "tiny" and plain["completion_tokens"] == 2 and plain["prompt_tokens"] > 0
    assert plain["session_affinity"] == "s1"
    for field in ("queue_ms", "prefill_ms", "decode_ms", "ttft_ms", "e2e_ms", "duration_ms", "request_id"):
        assert field in plain, field
    assert (
        streamed["stream"] is True
        and streamed["status"] == 200
        and streamed["endpoint"] == "chat.completions"
    )
    assert lines[2]["path"] == "/ready" and "model" not in lines[2]

"""Admission is atomic: a burst of simultaneous requests never gets past the queue or rejectIfBusy limits."""

from __future__ import annotations

import asyncio
import time

import httpx

from edgeinfer.engine.config import EngineConfig
from edgeinfer.node.config import ConnectionLimits

TWO_SEATS = EngineConfig(
    dtype="float32", batch_window_ms=0, block_size=4, kv_cache_memory_bytes=256 * 1024, max_num_seqs=2
)
LONG = {"model": "tiny", "prompt": "Hello", "max_tokens": 480, "ignore_eos": True}


async def _burst(
    url: str, path: str, body: dict, count: int, refused: int, headers: dict | None = None
) -> tuple[int, int]:
    """Send `count` requests at once; wait until `refused` of them got 429 (or 20 s), then hang up on the
    rest. Returns (429s, answers that were not 429 or are still pending)."""
    limits = httpx.Limits(max_connections=count + 10)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits, headers=headers) as client:
        tasks = [asyncio.create_task(client.post(path, json=body)) for _ in range(count)]
        rejected = 0
        try:
            for next_done in asyncio.as_completed(tasks, timeout=20):
                if (await next_done).status_code == 429:
                    rejected += 1
                if rejected == refused:
                    break
        except TimeoutError:
            pass
        for task in tasks:
            task.cancel()
        return rejected, count - rejected


def test_burst_never_exceeds_seats_plus_queue(node_factory, tiny_llama_dir) -> None:
    node = node_factory(
        {"tiny": tiny_llama_dir},
        preload=("tiny",),
        engine=TWO_SEATS,
        max_queue_depth=8,
        connections=ConnectionLimits(max_connections_per_client=128),  # all 100 come from loopback
    )
    rejected, admitted = asyncio.run(_burst(node.url, "/v1/completions", LONG, 100, refused=90))
    assert (rejected, admitted) == (90, 10)
    node.wait_idle("tiny", timeout=30)  # the admitted ones were aborted when the client hung up
    node.engine("tiny").check_integrity()
    # each stream gives its seat back once the engine has answered its abort, a moment after going idle
    deadline = time.monotonic() + 10
    while node.service.capacity.admitted("tiny") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert node.service.capacity.admitted("tiny") == 0


def test_burst_of_reject_if_busy_takes_only_the_free_seats(node_factory, tiny_llama_dir) -> None:
    node = node_factory({"tiny": tiny_llama_dir}, preload=("tiny",), engine=TWO_SEATS)
    body = {"prompt": "Hello", "max_tokens": 480, "options": {"rejectIfBusy": True}}
    rejected, admitted = asyncio.run(_burst(node.url, "/accounts/a/ai/run/tiny", body, 20, refused=18))
    assert (rejected, admitted) == (18, 2)
    node.wait_idle("tiny", timeout=30)
    node.engine("tiny").check_integrity()


def test_burst_never_exceeds_a_keys_concurrency(node_factory, tiny_llama_dir, make_tenant) -> None:
    node = node_factory(
        {"tiny": tiny_llama_dir}, preload=("tiny",), tenants=[make_tenant("t", "k", max_concurrent=3)]
    )
    auth = {"authorization": "Bearer k"}
    rejected, admitted = asyncio.run(_burst(node.url, "/v1/completions", LONG, 20, refused=17, headers=auth))
    assert (rejected, admitted) == (17, 3)
    node.wait_idle("tiny", timeout=30)
    node.engine("tiny").check_integrity()

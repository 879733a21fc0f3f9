"""The asyncio wrapper: concurrent streams, early exit aborts, bad input raises, loop survives."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from edgeinfer.engine.async_engine import AsyncLLMEngine
from edgeinfer.engine.errors import EngineInputError
from edgeinfer.types import EngineRequest, SamplingParams


@pytest.fixture
async def aengine(tiny_llama, engine_factory):
    eng = AsyncLLMEngine(engine_factory(tiny_llama, batch_window_ms=2.0))
    yield eng
    await eng.shutdown()


async def collect(eng: AsyncLLMEngine, rid: str, prompt: list[int], n: int) -> list[int]:
    toks = []
    async for out in eng.generate(
        EngineRequest(rid, prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    ):
        toks += out.new_token_ids
    return toks


async def test_concurrent_streams_match_offline(aengine, tiny_llama, engine_factory):
    prompts = [[5, 6, 7, 8], list(range(20, 50)), [9]]
    got = await asyncio.gather(*(collect(aengine, f"a{i}", p, 12) for i, p in enumerate(prompts)))
    offline = engine_factory(tiny_llama).generate(
        prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    )
    assert got == [r.token_ids for r in offline]


async def test_leaving_the_stream_aborts_and_frees_blocks(aengine):
    req = EngineRequest("leave", list(range(5, 60)), SamplingParams(max_tokens=400, ignore_eos=True))
    seen = 0
    async for _ in aengine.generate(req):
        seen += 1
        if seen == 3:
            break
    for _ in range(100):
        if aengine.stats().num_running == 0:
            break
        await asyncio.sleep(0.01)
    stats = aengine.stats()
    assert stats.num_running == 0 and stats.num_free_blocks == stats.num_total_blocks
    aengine.check_integrity()


async def test_a_caller_that_leaves_learns_what_was_computed(aengine):
    """Outputs the caller never took and tokens made before the abort landed are in the final count."""
    finals = []
    req = EngineRequest("slow", [5, 6, 7], SamplingParams(max_tokens=300, ignore_eos=True))
    taken = 0
    async with contextlib.aclosing(aengine.generate(req, finals.append)) as stream:
        async for out in stream:
            taken += len(out.new_token_ids)
            await asyncio.sleep(0.2)  # a slow reader: the engine runs ahead
            if taken >= 2:
                break
    (final,) = finals
    assert taken < final.completion_tokens <= 300 and final.prompt_tokens == 3
    # a request that had finished in the engine before its caller left: counted whole, no abort needed
    done = []
    async with contextlib.aclosing(
        aengine.generate(
            EngineRequest("quick", [5], SamplingParams(max_tokens=5, ignore_eos=True)), done.append
        )
    ) as stream:
        await anext(stream)
        for _ in range(200):
            if aengine.stats().num_running == 0:
                break
            await asyncio.sleep(0.01)
    assert [u.completion_tokens for u in done] == [5]


async def test_bad_request_raises_and_others_continue(aengine):
    with pytest.raises(EngineInputError):
        async for _ in aengine.generate(EngineRequest("bad", [10**7], SamplingParams())):
            pass
    assert len(await collect(aengine, "good", [5, 6], 4)) == 4

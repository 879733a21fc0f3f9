"""Scheduling must not change results: batched = alone, chunked = whole, cached = uncached,
preempted = unpreempted, for greedy and for seeded sampling."""

from __future__ import annotations

import pytest

from edgeinfer.types import SamplingParams

PROMPTS = [
    list(range(5, 45)),
    [7, 8, 9],
    list(range(100, 170)),
    [300, 301, 302, 303, 304, 305, 306, 307, 308],
]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)


def tokens(eng, prompts, sp):
    return [r.token_ids for r in eng.generate(prompts, sp)]


@pytest.fixture(scope="module")
def reference(tiny_models):
    """Each prompt alone, whole prefill, no prefix cache, plenty of blocks."""
    from engine.conftest import make_engine

    eng = make_engine(tiny_models["gemma3"], enable_prefix_caching=False)
    return {id(sp): [tokens(eng, [p], sp)[0] for p in PROMPTS] for sp in (GREEDY, SEEDED)}


@pytest.mark.parametrize("sp", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_batched_equals_one_at_a_time(sp, tiny_models, reference, engine_factory):
    eng = engine_factory(tiny_models["gemma3"], enable_prefix_caching=False)
    assert tokens(eng, PROMPTS, sp) == reference[id(sp)]


@pytest.mark.parametrize("sp", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_chunked_prefill_equals_whole(sp, tiny_models, reference, engine_factory):
    eng = engine_factory(tiny_models["gemma3"], max_num_batched_tokens=7, enable_prefix_caching=False)
    assert tokens(eng, PROMPTS, sp) == reference[id(sp)]


@pytest.mark.parametrize("sp", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_prefix_cache_hit_equals_miss(sp, tiny_models, reference, engine_factory):
    eng = engine_factory(tiny_models["gemma3"])
    tokens(eng, PROMPTS, sp)  # warm the cache
    hits_before = eng.stats().prefix_cache_hits
    assert tokens(eng, PROMPTS, sp) == reference[id(sp)]
    assert eng.stats().prefix_cache_hits > hits_before  # the second pass really hit


@pytest.mark.parametrize("sp", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_preempted_equals_unpreempted(sp, tiny_models, reference, engine_factory):
    eng = engine_factory(tiny_models["gemma3"], num_kv_blocks=30, enable_prefix_caching=False)
    assert tokens(eng, PROMPTS, sp) == reference[id(sp)]
    assert eng.stats().num_preemptions > 0  # the pool really was too small


def test_shared_prefix_across_requests_in_one_batch(tiny_models, engine_factory):
    base = list(range(10, 60))
    prompts = [base + [i] for i in range(3, 8)]
    eng = engine_factory(tiny_models["llama"])
    first = tokens(eng, prompts, GREEDY)
    alone = engine_factory(tiny_models["llama"], enable_prefix_caching=False)
    assert first == [tokens(alone, [p], GREEDY)[0] for p in prompts]

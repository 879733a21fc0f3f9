"""Scheduling must not change results for the MoE and MLA models: batched = alone, chunked = whole,
prefix-cached = uncached, preempted = unpreempted; every engine ends with zero leaked blocks."""

from __future__ import annotations

import pytest
import torch
from engine.conftest import make_engine

from edgeinfer.types import SamplingParams

FAMILIES = ["glm4_moe", "deepseek_v3"]
PROMPTS = [
    list(range(5, 45)),
    [7, 8, 9],
    list(range(100, 170)),
    [300, 301, 302, 303, 304, 305, 306, 307, 308],
]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
PARAMS = pytest.mark.parametrize("sp", [GREEDY, SEEDED], ids=["greedy", "seeded"])
FAMILY = pytest.mark.parametrize("family", FAMILIES)


def tokens(eng, prompts, sp):
    return [r.token_ids for r in eng.generate(prompts, sp)]


@pytest.fixture(scope="module")
def reference(moe_models):
    """Each prompt alone, whole prefill, no prefix cache, plenty of blocks."""
    out = {}
    for family in FAMILIES:
        eng = make_engine(moe_models[family], enable_prefix_caching=False)
        for sp in (GREEDY, SEEDED):
            out[family, id(sp)] = [tokens(eng, [p], sp)[0] for p in PROMPTS]
    return out


@FAMILY
@PARAMS
def test_batched_equals_one_at_a_time(family, sp, moe_models, reference, engine_factory):
    eng = engine_factory(moe_models[family], enable_prefix_caching=False)
    assert tokens(eng, PROMPTS, sp) == reference[family, id(sp)]


@FAMILY
def test_chunked_prefill_equals_whole(family, moe_models, reference, engine_factory):
    eng = engine_factory(moe_models[family], max_num_batched_tokens=7, enable_prefix_caching=False)
    assert tokens(eng, PROMPTS, GREEDY) == reference[family, id(GREEDY)]


@FAMILY
@PARAMS
def test_prefix_cache_hit_equals_miss(family, sp, moe_models, reference, engine_factory):
    eng = engine_factory(moe_models[family])
    tokens(eng, PROMPTS, sp)  # warm the cache
    hits_before = eng.stats().prefix_cache_hits
    assert tokens(eng, PROMPTS, sp) == reference[family, id(sp)]
    assert eng.stats().prefix_cache_hits > hits_before  # the second pass really hit


@FAMILY
@PARAMS
def test_preempted_equals_unpreempted(family, sp, moe_models, reference, engine_factory):
    eng = engine_factory(moe_models[family], num_kv_blocks=30, enable_prefix_caching=False)
    assert tokens(eng, PROMPTS, sp) == reference[family, id(sp)]
    assert eng.stats().num_preemptions > 0  # the pool really was too small


def test_two_engines_of_one_process_decode_in_their_own_mla_modes(moe_models, reference, engine_factory):
    """`mla_mode` is each engine's: an expand engine built beside an absorb one keeps expanding the latents
    (and the absorb one absorbing), and the tokens do not change."""
    absorb = engine_factory(moe_models["deepseek_v3"], mla_mode="absorb")
    expand = engine_factory(moe_models["deepseek_v3"], mla_mode="expand")
    assert type(absorb.model.model.layers[0].self_attn.impl).__name__ == "AbsorbLatentAttention"
    assert type(expand.model.model.layers[0].self_attn.impl).__name__ == "ExpandLatentAttention"
    assert tokens(expand, PROMPTS, GREEDY) == reference["deepseek_v3", id(GREEDY)]
    assert tokens(absorb, PROMPTS, GREEDY) == reference["deepseek_v3", id(GREEDY)]


def test_quantized_latent_cache_prefix_hit_equals_miss(moe_models, engine_factory):
    """An int8 latent cache: a prefix hit can only read stored (quantized) latents, so the miss must attend
    to them too. Then hit and miss logprobs differ by fp32 rounding (~5e-7, as with a lossless cache)
    rather than by int8 error (~6e-4 on this model)."""
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1)

    def logprobs(eng) -> torch.Tensor:
        return torch.tensor(
            [[lp.logprob for o in r.outputs for lp in o.logprobs] for r in eng.generate(PROMPTS, sp)]
        )

    miss = engine_factory(moe_models["deepseek_v3"], kv_cache_dtype="int8", enable_prefix_caching=False)
    hit = engine_factory(moe_models["deepseek_v3"], kv_cache_dtype="int8")
    logprobs(hit)  # warm the cache
    assert (logprobs(hit) - logprobs(miss)).abs().max().item() < 1e-5
    assert hit.stats().prefix_cache_hits > 0

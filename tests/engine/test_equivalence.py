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
    # blocks of one layer each (three KV groups: kv_cache/groups.py): the 70-token prompt alone needs 54
    eng = engine_factory(tiny_models["gemma3"], num_kv_blocks=75, enable_prefix_caching=False)
    assert tokens(eng, PROMPTS, sp) == reference[id(sp)]
    assert eng.stats().num_preemptions > 0  # the pool really was too small


def test_shared_prefix_across_requests_in_one_batch(tiny_models, engine_factory):
    base = list(range(10, 60))
    prompts = [base + [i] for i in range(3, 8)]
    eng = engine_factory(tiny_models["llama"])
    first = tokens(eng, prompts, GREEDY)
    alone = engine_factory(tiny_models["llama"], enable_prefix_caching=False)
    assert first == [tokens(alone, [p], GREEDY)[0] for p in prompts]


def prompt_logprobs(eng, prompt):
    (res,) = eng.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0))
    return [lp.logprob for lp in res.outputs[0].prompt_logprobs[1:]]


@pytest.mark.parametrize("kv_dtype,bound", [("int8", 0.005), ("fp8_e4m3", 0.02), ("int4", 0.06)])
def test_quantized_kv_cache_stays_close_and_prefix_caching_works(
    kv_dtype, bound, tiny_models, engine_factory
):
    """Quantized KV: prefix-cache hits reproduce the miss exactly (attention always reads the stored
    blocks); teacher-forced logprobs of the prompt stay within `bound` (mean |Δ logprob|) of full precision
    (greedy continuations of a random tiny model are too near-tied to compare token by token)."""
    eng = engine_factory(tiny_models["gemma3"], kv_cache_dtype=kv_dtype)
    first = tokens(eng, PROMPTS, GREEDY)
    assert tokens(eng, PROMPTS, GREEDY) == first
    ref = engine_factory(tiny_models["gemma3"])
    for prompt in PROMPTS[:3]:
        ours, exact = prompt_logprobs(eng, prompt), prompt_logprobs(ref, prompt)
        mean_diff = sum(abs(a - b) for a, b in zip(ours, exact, strict=True)) / len(exact)
        assert 0 < mean_diff < bound
    spec = eng.model.kv_spec  # K and V: heads x (payload bytes + scale bytes) per token per layer
    d = spec.k_dim
    per_head = d // 2 + (d // 32) * 2 if kv_dtype == "int4" else d + 4
    assert eng.layout.kv_bytes_per_token == spec.num_layers * 2 * spec.k_heads * per_head


@pytest.mark.parametrize("method", ["int8", "int4:32", "fp8"])
def test_weight_quantization_with_int8_kv_stays_within_kl_bound(method, tiny_models, engine_factory):
    """int8/int4/fp8 weights (lm_head and embeddings included) + int8 KV against the fp32 run: the
    next-token distributions over the prompt (teacher forcing, top-20 logprobs) stay close in KL."""
    ref = engine_factory(tiny_models["llama"])
    quant = engine_factory(tiny_models["llama"], quantization=method, kv_cache_dtype="int8")
    bound = {"int8": 3e-4, "fp8": 1e-3, "int4:32": 3e-3}[method]  # max KL per position, measured ~3x below
    for prompt in PROMPTS[:3]:
        sp = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=20)
        (a,) = ref.generate([prompt], sp)
        (b,) = quant.generate([prompt], sp)
        kls = [
            _kl_top(x.top, y.top)
            for x, y in zip(a.outputs[0].prompt_logprobs[1:], b.outputs[0].prompt_logprobs[1:], strict=True)
        ]
        assert max(kls) < bound
        changed = [
            x.logprob != y.logprob
            for x, y in zip(a.outputs[0].prompt_logprobs[1:], b.outputs[0].prompt_logprobs[1:], strict=True)
        ]
        assert any(changed)  # quantization really took effect
    assert quant.layout.weight_bytes < ref.layout.weight_bytes / 2


def _kl_top(p_top: list[tuple[int, float]], q_top: list[tuple[int, float]]) -> float:
    """KL(p || q) over p's top-20 tokens (q's missing ones get q's smallest listed logprob)."""
    import math

    q = dict(q_top)
    floor = min(q.values())
    return sum(math.exp(lp) * (lp - q.get(t, floor)) for t, lp in p_top)

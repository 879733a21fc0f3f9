"""Tenants' prefix caches on a real (tiny) model: isolation, public prefixes, scrubbed block reuse."""

from __future__ import annotations

from edgeinfer.engine.engine import LLMEngine
from edgeinfer.types import EngineRequest, SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _run(eng: LLMEngine, prompt: list[int], namespace: str, tenant: str = "") -> tuple[list[int], int]:
    """(greedy tokens, cached prompt tokens) of one request run alone."""
    rid = f"{tenant}-{len(eng.scheduler.kv.tables)}-{eng.stats().prefix_cache_queries}"
    eng.add_request(EngineRequest(rid, prompt, GREEDY, tenant=tenant, cache_namespace=namespace))
    tokens, cached = [], -1
    while eng.has_unfinished_requests():
        for out in eng.step():
            tokens += out.new_token_ids
            cached = out.usage.cached_tokens
    return tokens, cached


def test_other_tenant_misses_and_gets_the_same_tokens(tiny_llama, engine_factory) -> None:
    eng = engine_factory(tiny_llama)
    prompt = list(range(3, 40))
    first, cached = _run(eng, prompt, "ns-a", "a")
    assert cached == 0
    again, cached_a = _run(eng, prompt, "ns-a", "a")
    other, cached_b = _run(eng, prompt, "ns-b", "b")
    assert cached_a == 36 and again == first  # A's repeat hits its own blocks (block size 4)
    assert cached_b == 0 and other == first  # B computes it all itself, to the same greedy tokens


def test_public_prefix_is_hit_by_every_tenant_and_tails_stay_private(tiny_llama, engine_factory) -> None:
    public = list(range(5, 25))  # 5 whole blocks
    eng = engine_factory(tiny_llama)
    assert eng.add_public_prefix(public) == 5
    reference = engine_factory(tiny_llama, enable_prefix_caching=False)
    tail = list(range(60, 73))
    for tenant in ("a", "b"):
        tokens, cached = _run(eng, public + tail, f"ns-{tenant}", tenant)
        assert cached == 20, tenant  # the public blocks; the other tenant's tail is not visible
        assert tokens == _run(reference, public + tail, "")[0]
    tokens, cached = _run(eng, public + tail, "ns-a", "a")
    assert cached == 32  # A's own tail (3 whole blocks) on top of the public ones
    eng.check_integrity()


def test_a_block_reused_by_another_tenant_holds_none_of_the_first_ones(tiny_llama, engine_factory) -> None:
    eng = engine_factory(tiny_llama, num_kv_blocks=6)
    eng.add_request(EngineRequest("a", list(range(3, 22)), SamplingParams(max_tokens=5, temperature=0.0)))
    while eng.has_unfinished_requests():
        eng.step()  # 19 + 4 tokens computed: A's keys fill the whole pool but one slot
    k = eng.runner.storage.k[0].data
    before = k.clone()
    eng.add_request(EngineRequest("b", list(range(100, 106)), GREEDY, tenant="b", cache_namespace="ns-b"))
    eng.step()  # B's prefill: 6 tokens in 2 of A's old blocks, scrubbed first
    (table,) = eng.scheduler.kv.tables["b"]
    assert all(before[b][:2].abs().sum() > 0 for b in table)  # A had written them
    assert k[table[1]][2:].abs().sum() == 0  # the slots B has not written yet: zero, not A's keys
    assert k[table[1]][:2].abs().sum() > 0
    while eng.has_unfinished_requests():
        eng.step()

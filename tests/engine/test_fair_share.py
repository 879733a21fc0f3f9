"""Fair share of prefill across tenants, with a fake runner: no torch, no model."""

from __future__ import annotations

import itertools

import pytest

from edgeinfer.engine.kv_cache import KVCacheManager
from edgeinfer.engine.scheduler import Request, Scheduler, SchedulerConfig, SchedulingPolicy
from edgeinfer.types import FinishReason, SamplingParams

_ids = itertools.count()


def _scheduler(fair: bool, policy: str = "fcfs") -> Scheduler:
    kv = KVCacheManager(4096, 16)
    cfg = SchedulerConfig(
        max_num_seqs=64,
        max_num_batched_tokens=256,
        max_model_len=4096,
        policy=SchedulingPolicy(policy),
        fair_share=fair,
    )
    return Scheduler(cfg, kv, lambda: 0.0)


def _req(tenant: str, prompt_len: int, priority: int = 0, weight: float = 1.0) -> Request:
    n = next(_ids)
    return Request(
        request_id=f"{tenant}-{n}",
        prompt_token_ids=[1 + (n * 7 + i) % 500 for i in range(prompt_len)],
        sampling=SamplingParams(max_tokens=2, ignore_eos=True),
        tenant=tenant,
        priority=priority,
        weight=weight,
    )


def _first_token_steps(s: Scheduler, reqs: list[Request]) -> dict[str, int]:
    """Step until all finish; the step at which each request got its first token."""
    first: dict[str, int] = {}
    for r in reqs:
        s.add_request(r)
    for n in itertools.count():
        if not s.num_unfinished:
            break
        out = s.schedule()
        for r in s.update(out, {c.request_id: 7 for c in out.chunks if c.sample}):
            first.setdefault(r.request_id, n)
    s.check_integrity()
    return first


@pytest.mark.parametrize("fair", [True, False])
def test_a_single_short_prompt_is_not_held_behind_a_burst(fair: bool) -> None:
    s = _scheduler(fair)
    burst = [_req("burst", 200) for _ in range(50)]
    short = _req("quiet", 20)
    first = _first_token_steps(s, [*burst, short])
    last_burst_prefill = max(first[r.request_id] for r in burst)
    if fair:
        assert first[short.request_id] <= 2 < last_burst_prefill
    else:  # arrival order across everyone: the short prompt waits for the whole burst's prefill
        assert first[short.request_id] >= last_burst_prefill


def test_weights_split_the_prefill_budget() -> None:
    s = _scheduler(True)
    heavy = [_req("heavy", 64, weight=3.0) for _ in range(40)]
    light = [_req("light", 64) for _ in range(40)]
    for r in heavy + light:
        s.add_request(r)
    served = {"heavy": 0, "light": 0}
    for _ in range(6):
        out = s.schedule()
        for c in out.chunks:
            served[c.request_id.split("-")[0]] += c.num_tokens
        s.update(out, {c.request_id: 7 for c in out.chunks if c.sample})
    assert 2.5 <= served["heavy"] / served["light"] <= 3.5, served


def test_priority_classes_still_come_first() -> None:
    s = _scheduler(True, policy="priority")
    low = [_req("a", 200, priority=5) for _ in range(10)]
    urgent = _req("b", 200, priority=0)
    first = _first_token_steps(s, [*low, urgent])
    assert first[urgent.request_id] <= min(first[r.request_id] for r in low)


def test_a_tenant_arriving_mid_burst_gets_its_first_token_in_the_next_step() -> None:
    s = _scheduler(True)
    for r in [_req("burst", 700) for _ in range(6)]:
        s.add_request(r)
    for _ in range(3):  # the burst alone: whole budgets of its prefill
        out = s.schedule()
        assert out.num_tokens == 256
        s.update(out, {c.request_id: 7 for c in out.chunks if c.sample})
    short = _req("quiet", 20)
    s.add_request(short)
    out = s.schedule()
    mine = [c for c in out.chunks if c.request_id == short.request_id]
    assert len(mine) == 1 and mine[0].sample and mine[0].num_tokens == 20
    others = sum(c.num_tokens for c in out.chunks if c.request_id != short.request_id)
    assert others <= 256 // 4  # the step that brings it its first token stays short
    s.update(out, {c.request_id: 7 for c in out.chunks if c.sample})
    assert s.schedule().num_tokens == 256  # then the burst has the budget again


def test_the_step_budget_follows_the_step_time_target() -> None:
    kv = KVCacheManager(4096, 16)
    cfg = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=1024, max_model_len=4096, max_step_ms=250.0)
    s = Scheduler(cfg, kv, lambda: 0.0)
    s.add_request(_req("a", 3000))
    s.add_request(_req("b", 3000))  # a second request: the steps keep to the target
    assert s.schedule().num_tokens == 1024  # nothing measured yet: the maximum
    for tokens in (1024, 1, 300, 1, 600):  # steps cost 50 ms + 1 ms a token here
        s.observe_step(tokens, 0.050 + 0.001 * tokens)
    assert s.step_budget() == 200
    out = s.schedule()
    assert out.num_tokens == 200 and not out.chunks[0].sample


def test_a_request_alone_takes_the_largest_chunk() -> None:
    """Nothing else waiting and no other tenant present: chunking would only slow the lone prompt."""
    now = [0.0]
    kv = KVCacheManager(4096, 16)
    cfg = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=1024, max_model_len=4096, max_step_ms=250.0)
    s = Scheduler(cfg, kv, lambda: now[0])
    for tokens in (1, 300, 1, 600):  # 50 ms + 1 ms a token: 200 tokens fit the target
        s.observe_step(tokens, 0.050 + 0.001 * tokens)
    lone = _req("a", 3000)
    s.add_request(lone)
    assert s.schedule().num_tokens == 1024
    s.add_request(_req("b", 10))  # someone arrives: the next steps are short again
    assert s.step_budget() == 200


def test_a_second_tenant_present_shortens_the_steps() -> None:
    now = [0.0]
    kv = KVCacheManager(4096, 16)
    cfg = SchedulerConfig(
        max_num_seqs=64,
        max_num_batched_tokens=1024,
        max_model_len=4096,
        max_step_ms=250.0,
        shared_step_ms=75.0,
    )
    s = Scheduler(cfg, kv, lambda: now[0])
    for tokens in (1, 200, 1, 200):  # 50 ms + 1 ms a token
        s.observe_step(tokens, 0.050 + 0.001 * tokens)
    s.add_request(_req("a", 3000))
    assert s.step_budget() == 1024  # alone: the largest chunk
    quiet = _req("b", 10)
    s.add_request(quiet)
    assert s.step_budget() == 25  # b present: (75 - 50) ms buys 25 tokens
    s.finish(quiet.request_id, FinishReason.STOP)
    now[0] += 0.5
    assert s.step_budget() < 200  # b sent a moment ago: still present
    now[0] += 1.0
    assert s.step_budget() == 1024


def test_a_tenant_filling_the_pool_gives_way_to_one_waiting_with_little() -> None:
    kv = KVCacheManager(64, 16)  # 63 usable blocks: two 500-token prompts need 64
    s = Scheduler(
        SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=256, max_model_len=4096), kv, lambda: 0.0
    )
    burst = [_req("burst", 500) for _ in range(2)]
    for r in burst:
        r.sampling = SamplingParams(max_tokens=4, ignore_eos=True)  # still running when `short` comes
        s.add_request(r)
    for _ in range(3):  # the first decodes, the second is half way through its prompt
        out = s.schedule()
        s.update(out, {c.request_id: 7 for c in out.chunks if c.sample})
    short = _req("quiet", 20)
    s.add_request(short)
    out = s.schedule()
    assert any(c.request_id == short.request_id and c.sample for c in out.chunks)
    assert out.preempted == [burst[1].request_id]  # the one mid-prompt, recomputed later
    s.update(out, {c.request_id: 7 for c in out.chunks if c.sample})
    _first_token_steps(s, [])  # the rest runs to the end
    assert not s.num_unfinished


def test_no_preemption_for_a_tenant_already_holding_as_much() -> None:
    kv = KVCacheManager(64, 16)
    s = Scheduler(
        SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=512, max_model_len=4096), kv, lambda: 0.0
    )
    for r in (_req("a", 480), _req("b", 480)):
        s.add_request(r)
    out = s.schedule()
    s.update(out, {c.request_id: 7 for c in out.chunks if c.sample})
    late = _req("b", 400)
    s.add_request(late)
    out = s.schedule()
    assert not out.preempted  # b holds as many blocks as a: it waits like anyone

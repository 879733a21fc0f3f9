"""Fair share of prefill across tenants, with a fake runner: no torch, no model."""

from __future__ import annotations

import itertools

import pytest

from edgeinfer.engine.kv_cache import KVCacheManager
from edgeinfer.engine.scheduler import Request, Scheduler, SchedulerConfig
from edgeinfer.types import SamplingParams

_ids = itertools.count()


def _scheduler(fair: bool, policy: str = "fcfs") -> Scheduler:
    kv = KVCacheManager(4096, 16)
    cfg = SchedulerConfig(64, 256, max_model_len=4096, policy=policy, fair_share=fair)
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

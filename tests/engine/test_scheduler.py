"""Scheduler policy with a fake runner: no torch, no model."""

from __future__ import annotations

import itertools

import pytest

from edgeinfer.engine.kv_cache import KVCacheManager
from edgeinfer.engine.scheduler import Request, RequestStatus, Scheduler, SchedulerConfig, SchedulingPolicy
from edgeinfer.types import FinishReason, SamplingParams

EOS = 0


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def make(max_seqs=64, budget=256, blocks=512, window_ms=0.0, policy="fcfs", clock=None, block_size=16):
    kv = KVCacheManager(blocks, block_size)
    cfg = SchedulerConfig(
        max_num_seqs=max_seqs,
        max_num_batched_tokens=budget,
        max_model_len=4096,
        batch_window_ms=window_ms,
        policy=SchedulingPolicy(policy),
    )
    return Scheduler(cfg, kv, clock or FakeClock())


_ids = itertools.count()


def req(prompt_len: int, max_tokens: int, priority: int = 0, arrival: float = 0.0) -> Request:
    return Request(
        request_id=f"r{next(_ids)}",
        prompt_token_ids=[1 + i % 50 for i in range(prompt_len)],
        sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        eos_token_ids=frozenset({EOS}),
        priority=priority,
        arrival_time=arrival,
    )


def step(s: Scheduler) -> tuple[list[str], list[Request]]:
    """A fake runner: every sampling chunk produces token 7 (never EOS)."""
    out = s.schedule()
    sampled = {c.request_id: 7 for c in out.chunks if c.sample}
    done = [r for r in s.update(out, sampled) if r.is_finished]
    return [c.request_id for c in out.chunks], done


def test_chunked_prefill_respects_budget_and_catches_up():
    s = make(budget=64)
    r = req(200, 3)
    s.add_request(r)
    sizes = []
    while s.num_unfinished:
        out = s.schedule()
        sizes.append(out.num_tokens)
        assert out.num_tokens <= 64
        s.update(out, {c.request_id: 7 for c in out.chunks if c.sample})
    assert sizes == [64, 64, 64, 8, 1, 1]
    assert r.output_token_ids == [7, 7, 7] and r.finish_reason == FinishReason.LENGTH
    s.check_integrity()
    assert s.kv.pool.num_free == s.kv.pool.num_blocks


def test_decodes_go_before_prefill_chunks():
    s = make(budget=32)
    short = req(4, 50)
    s.add_request(short)
    step(s)
    s.add_request(req(500, 1))
    for _ in range(5):
        out = s.schedule()
        ids = [c.request_id for c in out.chunks]
        assert ids[0] == short.request_id and out.chunks[0].num_tokens == 1
        s.update(out, {c.request_id: 7 for c in out.chunks if c.sample})


def test_no_starvation_long_generation_and_twenty_short_requests():
    """A 2,000-token generation runs; 20 short requests (16-token prompts, 8 new tokens) arrive one per
    step. Each short request must finish within 1 (prefill) + 8 (decode) + 2 steps of slack after it
    arrives, however long the big one still has to go."""
    s = make(max_seqs=8, budget=64, blocks=1024)
    long = req(32, 2000)
    s.add_request(long)
    arrived: dict[str, int] = {}
    finished: dict[str, int] = {}
    for t in range(400):
        if t >= 5 and len(arrived) < 20:
            r = req(16, 8)
            s.add_request(r)
            arrived[r.request_id] = t
        _, done = step(s)
        for r in done:
            finished[r.request_id] = t
    assert len(finished) == 20 and not long.is_finished
    bound = 1 + 8 + 2
    worst = max(finished[r] - arrived[r] + 1 for r in arrived)
    assert worst <= bound, f"a short request took {worst} steps (bound {bound})"


def test_preemption_by_recompute_when_blocks_run_out():
    s = make(budget=256, blocks=6, block_size=4)  # 24 token slots
    a, b = req(8, 12), req(8, 12)
    s.add_request(a)
    s.add_request(b)
    preempted = []
    while s.num_unfinished:
        out = s.schedule()
        preempted += out.preempted
        s.update(out, {c.request_id: 7 for c in out.chunks if c.sample})
        s.check_integrity()
    assert preempted and set(preempted) == {b.request_id}  # the later arrival yields, every time
    assert a.output_token_ids == [7] * 12 and b.output_token_ids == [7] * 12
    assert b.num_preemptions >= 1 and s.num_preemptions >= 1
    assert s.kv.pool.num_free == 6


def test_priority_policy_admits_and_preempts_by_priority():
    s = make(max_seqs=1, policy="priority")
    low, high = req(4, 2, priority=5), req(4, 2, priority=0)
    s.add_request(low)
    s.add_request(high)
    ids, _ = step(s)
    assert ids == [high.request_id]


def test_batch_window_admits_a_burst_together():
    clock = FakeClock()
    s = make(window_ms=5.0, clock=clock)
    a = req(4, 4)
    s.add_request(a)
    assert s.schedule().is_empty  # window still open
    clock.t = 0.003
    b = req(4, 4)
    s.add_request(b)
    assert s.schedule().is_empty
    clock.t = 0.005
    out = s.schedule()
    assert {c.request_id for c in out.chunks} == {a.request_id, b.request_id}


def test_batch_window_opens_early_when_seats_are_full():
    clock = FakeClock()
    s = make(max_seqs=2, window_ms=50.0, clock=clock)
    s.add_request(req(4, 4))
    s.add_request(req(4, 4))
    assert len(s.schedule().chunks) == 2


def test_abort_waiting_and_running_frees_blocks():
    s = make(max_seqs=1)
    a, b = req(40, 100), req(40, 100)
    s.add_request(a)
    s.add_request(b)
    step(s)
    assert a.status == RequestStatus.RUNNING and b.status == RequestStatus.WAITING
    s.abort(b.request_id)
    s.abort(a.request_id)
    assert a.finish_reason == FinishReason.ABORT and s.num_unfinished == 0
    s.check_integrity()
    assert s.kv.pool.num_free == s.kv.pool.num_blocks
    assert set(s.schedule().finished) == {a.request_id, b.request_id}


@pytest.mark.parametrize("prompt_len", [4096, 5000])
def test_prompt_longer_than_context_is_refused(prompt_len):
    s = make()
    with pytest.raises(ValueError, match="context"):
        s.add_request(req(prompt_len, 1))
    assert s.num_unfinished == 0


def test_prompt_larger_than_the_whole_pool_is_refused():
    s = make(blocks=2, block_size=4)
    with pytest.raises(ValueError, match="KV cache"):
        s.add_request(req(20, 1))

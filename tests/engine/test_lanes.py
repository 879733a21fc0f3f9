"""Interactive and batch lanes (types.request.Lane): interactive work first in the queue, the budget,
seats and KV blocks; batch work fills what is left and gives way, preempted and recomputed, with the same
output as if nothing had interrupted it."""

from __future__ import annotations

import itertools

import pytest

from edgeinfer.engine.kv_cache import KVCacheManager
from edgeinfer.engine.scheduler import Request, Scheduler, SchedulerConfig, SchedulingPolicy
from edgeinfer.types import EngineRequest, SamplingParams
from edgeinfer.types.request import Lane

_ids = itertools.count()


def _req(lane: Lane, prompt_len: int, tenant: str = "t") -> Request:
    n = next(_ids)
    return Request(
        request_id=f"{lane}-{n}",
        prompt_token_ids=[1 + (n * 7 + i) % 500 for i in range(prompt_len)],
        sampling=SamplingParams(max_tokens=8, ignore_eos=True),
        tenant=tenant,
        lane=lane,
    )


def _scheduler(fair: bool, seats: int = 64, blocks: int = 4096, budget: int = 256, policy: str = "fcfs"):
    cfg = SchedulerConfig(
        max_num_seqs=seats,
        max_num_batched_tokens=budget,
        max_model_len=4096,
        fair_share=fair,
        policy=SchedulingPolicy(policy),
    )
    return Scheduler(cfg, KVCacheManager(blocks, 16), lambda: 0.0)


def _step(s: Scheduler):
    out = s.schedule()
    s.update(out, {c.request_id: 7 for c in out.chunks if c.sample})
    return out


@pytest.mark.parametrize("fair", [True, False])
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_an_interactive_request_goes_before_batch_work_that_came_first(fair: bool, policy: str) -> None:
    s = _scheduler(fair, seats=1, policy=policy)
    batch, interactive = _req(Lane.BATCH, 40), _req(Lane.INTERACTIVE, 40)
    s.add_request(batch)
    s.add_request(interactive)
    out = _step(s)
    assert [c.request_id for c in out.chunks] == [interactive.request_id]


@pytest.mark.parametrize("fair", [True, False])
def test_batch_work_gives_its_seat_to_an_interactive_request(fair: bool) -> None:
    s = _scheduler(fair, seats=2)
    batch = [_req(Lane.BATCH, 20) for _ in range(2)]
    for r in batch:
        s.add_request(r)
    _step(s)
    assert {r.request_id for r in s.running} == {r.request_id for r in batch}
    interactive = _req(Lane.INTERACTIVE, 20)
    s.add_request(interactive)
    out = _step(s)
    assert out.preempted == [batch[-1].request_id] and out.yielded == 1
    assert interactive in s.running and batch[-1] not in s.running
    while s.requests:  # the preempted one runs again once there is room, and finishes
        _step(s)


@pytest.mark.parametrize("fair", [True, False])
def test_batch_work_gives_its_kv_blocks_to_an_interactive_request(fair: bool) -> None:
    s = _scheduler(fair, blocks=9)  # 8 usable blocks of 16: two 60-token prompts fill them
    batch = [_req(Lane.BATCH, 60) for _ in range(2)]
    for r in batch:
        s.add_request(r)
    _step(s)
    assert len(s.running) == 2
    interactive = _req(Lane.INTERACTIVE, 40)
    s.add_request(interactive)
    out = _step(s)
    assert batch[-1].request_id in out.preempted
    assert any(c.request_id == interactive.request_id for c in out.chunks)
    while s.requests:
        _step(s)
    s.check_integrity()


def test_batch_prefill_takes_only_the_budget_interactive_work_leaves() -> None:
    s = _scheduler(True, budget=100)
    batch, interactive = _req(Lane.BATCH, 500), _req(Lane.INTERACTIVE, 70)
    s.add_request(batch)
    s.add_request(interactive)
    out = _step(s)
    tokens = {c.request_id: c.num_tokens for c in out.chunks}
    assert tokens == {interactive.request_id: 70, batch.request_id: 30}


def test_interactive_work_never_gives_way_to_batch_work() -> None:
    s = _scheduler(True, seats=1)
    interactive = _req(Lane.INTERACTIVE, 20)
    s.add_request(interactive)
    _step(s)
    s.add_request(_req(Lane.BATCH, 20))
    out = _step(s)
    assert not out.preempted and [c.request_id for c in out.chunks] == [interactive.request_id]


def test_preempted_batch_work_answers_as_if_uninterrupted(engine_factory, tiny_models) -> None:
    """Greedy batch answers with interactive requests taking their seats mid-generation equal the same
    batch answers alone."""
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = [[5, 17, 42, 99, 3, 250, 7], [300, 301, 5, 6, 9], [11, 12, 13, 14, 15, 16]]
    alone = engine_factory(tiny_models["llama"]).generate(prompts, sp)
    engine = engine_factory(tiny_models["llama"], max_num_seqs=3)
    for i, p in enumerate(prompts):
        engine.add_request(EngineRequest(f"b{i}", p, sp, lane=Lane.BATCH))
    steps = 0
    answers: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        steps += 1
        if steps in (3, 9):  # interactive work arrives while the batch decodes
            for j in range(2):
                engine.add_request(EngineRequest(f"i{steps}-{j}", [40 + j, 41, 42], sp))
        for out in engine.step():
            answers.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert engine.scheduler.num_preemptions >= 2
    assert [answers[f"b{i}"] for i in range(3)] == [a.token_ids for a in alone]

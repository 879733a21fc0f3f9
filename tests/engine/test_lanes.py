"""Interactive and batch lanes (types.request.Lane): interactive work first in the queue, the budget,
seats and KV blocks; batch work fills what is left and gives way, preempted and recomputed, with the same
output as if nothing had interrupted it."""

from __future__ import annotations

import itertools

import pytest

from edgeinfer.engine.kv_cache import KVCacheManager
from edgeinfer.engine.scheduler import Request, Scheduler, SchedulerConfig, SchedulingPolicy
from edgeinfer.types import EngineRequest, FinishReason, SamplingParams
from edgeinfer.types.request import Lane

_ids = itertools.count()


def _req(lane: Lane, prompt_len: int, tenant: str = "t", max_tokens: int = 8) -> Request:
    n = next(_ids)
    return Request(
        request_id=f"{lane}-{n}",
        prompt_token_ids=[1 + (n * 7 + i) % 500 for i in range(prompt_len)],
        sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        tenant=tenant,
        lane=lane,
    )


def _scheduler(
    fair: bool,
    seats: int = 64,
    blocks: int = 4096,
    budget: int = 256,
    policy: str = "fcfs",
    batch_step_ms: float | None = None,
    interruptible: bool = False,
):
    cfg = SchedulerConfig(
        max_num_seqs=seats,
        max_num_batched_tokens=budget,
        max_model_len=4096,
        fair_share=fair,
        policy=SchedulingPolicy(policy),
        batch_step_ms=batch_step_ms,
        interruptible_steps=interruptible,
    )
    return Scheduler(cfg, KVCacheManager(blocks, 16), lambda: 0.0)


def _teach(s: Scheduler, fixed: float, per_row: float, per_token: float) -> None:
    """Steps of several mixes of decode rows and prefill tokens, timed by this model."""
    for rows, tokens in [(1, 0), (40, 0), (10, 200), (0, 500), (20, 16)] * 4:
        s.observe_step(rows + tokens, fixed + per_row * rows + per_token * tokens, rows)


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


@pytest.mark.parametrize("fair", [True, False])
def test_batch_work_sits_out_the_steps_that_bring_interactive_first_tokens(fair: bool) -> None:
    """A step that prefills interactive work carries no batch work (its decodes and prefill would
    lengthen the step the first token waits for); the steps after give batch work what is left."""
    s = _scheduler(fair, budget=100)
    batch = _req(Lane.BATCH, 60)
    s.add_request(batch)
    _step(s)  # the batch request alone: prefilled, decoding from now on
    interactive = _req(Lane.INTERACTIVE, 70)
    s.add_request(interactive)
    first = {c.request_id: c.num_tokens for c in _step(s).chunks}
    assert first == {interactive.request_id: 70}
    later = {c.request_id: c.num_tokens for c in _step(s).chunks}
    assert later == {interactive.request_id: 1, batch.request_id: 1}
    long_batch = _req(Lane.BATCH, 500)
    s.add_request(long_batch)
    shared = {c.request_id: c.num_tokens for c in _step(s).chunks}
    assert shared == {interactive.request_id: 1, batch.request_id: 1, long_batch.request_id: 98}


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


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_the_waiting_batch_count_follows_the_queue(policy: str) -> None:
    """`waiting.num_batch` (read by the node without the engine's lock, for admission and the status that
    routers see) is a counter: it must equal a walk of the queue through admissions and preemptions."""
    s = _scheduler(fair=True, seats=3, blocks=24, policy=policy)
    for _ in range(4):
        s.add_request(_req(Lane.BATCH, 60))
    seen_preemption = False
    for step in range(60):
        if step in (2, 3, 5):  # interactive arrivals take the batch requests' seats
            s.add_request(_req(Lane.INTERACTIVE, 60))
        out = _step(s)
        seen_preemption |= bool(out.preempted)
        assert s.waiting.num_batch == sum(r.is_batch for r in s.waiting)
        if len(s.waiting) == 0 and not s.running:
            break
    assert seen_preemption


@pytest.mark.parametrize("fair", [True, False])
def test_a_step_with_batch_work_fits_the_batch_step_time(fair: bool) -> None:
    """With batch work running beside interactive decodes, a step takes what fits in `batch_step_ms` by
    the line of decode-only steps (every interactive decode still), and the batch decodes take turns, so
    all of them progress."""
    s = _scheduler(fair, seats=64, budget=256, batch_step_ms=50.0)
    batch = [_req(Lane.BATCH, 4, max_tokens=100) for _ in range(60)]
    interactive = _req(Lane.INTERACTIVE, 4, max_tokens=100)
    for r in [interactive, *batch]:
        s.add_request(r)
    while any(r.is_prefilling for r in s.running) or len(s.waiting):
        _step(s)  # no step cost known yet: no time budget, everyone is admitted
    _teach(s, 0.010, 0.001, 0.002)  # 10 ms + 1 ms a decode row: 40 rows fit in 50 ms
    turns = dict.fromkeys((r.request_id for r in s.running if r.is_batch), 0)
    assert len(turns) > 40  # more batch decodes than one step can take
    for _ in range(3):
        out = _step(s)
        assert sum(c.num_tokens for c in out.chunks) <= 40
        assert interactive.request_id in {c.request_id for c in out.chunks}
        for c in out.chunks:
            if c.request_id in turns:
                turns[c.request_id] += 1
    assert min(turns.values()) >= 1


def test_batch_work_alone_runs_in_full_steps() -> None:
    """Without interactive traffic of late, batch steps are not kept short: a nightly job gets the node."""
    s = _scheduler(True, seats=64, budget=256, batch_step_ms=50.0)
    for _ in range(60):
        s.add_request(_req(Lane.BATCH, 4, max_tokens=100))
    while any(r.is_prefilling for r in s.running) or len(s.waiting):
        _step(s)
    s.cost.observe(10, 0.020)
    s.cost.observe(50, 0.060)  # 40 tokens would fit in 50 ms
    assert sum(c.num_tokens for c in _step(s).chunks) == 60


def test_interruptible_batch_only_steps_run_whole_beside_interactive_traffic() -> None:
    """Where interactive work stops a batch-only step (runner/interrupt.py), such a step takes the whole
    budget even while interactive requests come and go; a step with interactive decodes stays short."""
    s = _scheduler(True, seats=64, budget=256, batch_step_ms=50.0, interruptible=True)
    interactive = _req(Lane.INTERACTIVE, 4, max_tokens=3)
    for r in [interactive, *(_req(Lane.BATCH, 4, max_tokens=100) for _ in range(60))]:
        s.add_request(r)
    while any(r.is_prefilling for r in s.running) or len(s.waiting):
        _step(s)
    s.cost.observe(10, 0.020)
    s.cost.observe(50, 0.060)  # 40 tokens fit in 50 ms
    while interactive.request_id in s.requests:
        out = _step(s)
        assert sum(c.num_tokens for c in out.chunks) <= 40 and not out.interruptible
    out = _step(s)  # the interactive request just ended: batch work alone, all 60 decodes
    assert sum(c.num_tokens for c in out.chunks) == 60 and out.interruptible


def test_beside_interactive_decodes_batch_decodes_fill_by_the_decode_line() -> None:
    """A decode row costs a fraction of a prefill token: steps beside interactive decodes are sized by the
    line of decode-only steps, holding decodes only while they fill the step, and batch prefill in what
    time the decodes leave."""
    s = _scheduler(True, seats=64, budget=256, batch_step_ms=30.0, interruptible=True)
    interactive = _req(Lane.INTERACTIVE, 4, max_tokens=100)
    batch = [_req(Lane.BATCH, 4, max_tokens=100) for _ in range(60)]
    for r in [interactive, *batch]:
        s.add_request(r)
    while any(r.is_prefilling for r in s.running) or len(s.waiting):
        _step(s)
    _teach(s, 0.020, 0.0005, 0.001)  # 20 ms + 0.5 ms a decode row (20 in 30 ms) + 1 ms a prefill token
    out = _step(s)
    assert len(out.chunks) == 20 and all(c.is_decode for c in out.chunks)
    for r in batch[6:]:
        s.finish(r.request_id, FinishReason.ABORT)  # 6 batch decodes left, one more batch request waits
    late = _req(Lane.BATCH, 40, max_tokens=4)
    s.add_request(late)
    out = _step(s)
    # 7 decodes take 23.5 ms; the 6.5 ms left prefill 6 tokens of the newcomer at 1 ms a token
    assert {c.request_id: c.num_tokens for c in out.chunks}.get(late.request_id) == 6
    assert sum(c.is_decode for c in out.chunks) == 7

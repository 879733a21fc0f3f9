"""A batch-only step gives way to interactive work at its next check (runner/interrupt.py: between layers in
the fused step, before each weighted module in the eager forward): the step is dropped as if it had not run,
and run again later with the same result; steps holding interactive work are never stopped."""

from __future__ import annotations

import pytest
from helpers.fused_step import bf16_engine
from torch import nn

from edgeinfer.engine import kernels
from edgeinfer.engine.engine import LLMEngine
from edgeinfer.types import EngineRequest, SamplingParams
from edgeinfer.types.request import Lane

PROMPTS = [list(range(5, 45)), list(range(50, 61)), [7] * 23]
SP = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=1)


def _add(engine: LLMEngine, lane: Lane, tag: str = "") -> None:
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(EngineRequest(f"{lane}{tag}-{i}", prompt, SP, lane=lane))


def _drain(engine: LLMEngine, interrupt_at: set[int] = frozenset(), inside: nn.Module | None = None):
    """Step to the end; at the steps numbered in `interrupt_at`, interactive work 'arrives': before the
    step (the flag set) or, with `inside`, as the step's eager forward reaches that module."""
    answers: dict[str, list[tuple[int, float]]] = {}
    step = 0
    hook = None
    while engine.has_unfinished_requests():
        if step in interrupt_at:
            if inside is None:
                engine.runner.interrupt.request()
            else:
                hook = inside.register_forward_pre_hook(lambda *_: engine.runner.interrupt.request())
        for out in engine.step():
            answers.setdefault(out.request_id, []).extend((lp.token_id, lp.logprob) for lp in out.logprobs)
        if hook is not None:
            hook.remove()
            hook = None
        engine.runner.interrupt.clear()
        step += 1
    engine.check_integrity()
    return answers


@pytest.fixture
def engine(tiny_models):
    if not kernels.cpu_has_avx2():
        pytest.skip("bf16 models keep torch's kernels without AVX2")
    return bf16_engine(tiny_models["llama"])


def test_interrupted_batch_steps_give_the_same_answers(engine):
    _add(engine, Lane.BATCH)
    plain = _drain(engine)
    assert engine.num_interrupted_steps == 0
    # decode steps (the fused step, stopped before a layer) and the prefill (eager, stopped mid-forward)
    _add(engine, Lane.BATCH, "again")
    again = _drain(engine, interrupt_at={0, 3, 4, 7})
    assert engine.num_interrupted_steps == 4
    _add(engine, Lane.BATCH, "mid")
    mid = _drain(engine, interrupt_at={0}, inside=engine.model.model.layers[1])
    assert engine.num_interrupted_steps == 5
    for i in range(len(PROMPTS)):
        assert again[f"batchagain-{i}"] == mid[f"batchmid-{i}"] == plain[f"batch-{i}"]


def test_an_eager_step_stops_inside_the_layer(engine):
    """Interactive work arriving during a batch prefill's MLP: its down projection never runs, nor does
    anything after it; the step is redone whole with the same answers. Unarmed steps carry no hooks."""
    mlp = engine.model.model.layers[0].mlp
    ran_after: list[str] = []
    mlp.down_proj.register_forward_hook(lambda *_: ran_after.append("down_proj"))
    engine.model.model.layers[1].register_forward_hook(lambda *_: ran_after.append("layer 1"))
    _add(engine, Lane.BATCH)
    plain = _drain(engine)
    ran_after.clear()
    _add(engine, Lane.BATCH, "mid")
    arrived = mlp.gate_up_proj.register_forward_pre_hook(lambda *_: engine.runner.interrupt.request())
    assert engine.step() == [] and engine.num_interrupted_steps == 1  # the prefill of all three
    assert ran_after == []
    arrived.remove()
    engine.runner.interrupt.clear()
    assert not mlp.down_proj._forward_pre_hooks and not engine.model.model.layers[0]._forward_pre_hooks
    mid = _drain(engine)
    for i in range(len(PROMPTS)):
        assert mid[f"batchmid-{i}"] == plain[f"batch-{i}"]


def test_steps_with_interactive_work_run_to_the_end(engine):
    _add(engine, Lane.INTERACTIVE)
    _add(engine, Lane.BATCH)
    answers = _drain(engine, interrupt_at=set(range(3)))
    assert engine.num_interrupted_steps == 0  # the first steps hold interactive work
    assert all(len(answers[f"{lane}-{i}"]) == 10 for lane in Lane for i in range(len(PROMPTS)))


def test_interactive_arrivals_raise_the_flag_batch_ones_do_not(tiny_models):
    """Through the async engine, as the server adds requests: the flag goes up as an interactive request
    is handed over (not when the engine thread takes it in, a step later)."""
    import asyncio

    from edgeinfer.engine.async_engine import AsyncLLMEngine

    engine = bf16_engine(tiny_models["llama"])
    raised: list[str] = []
    interrupt = engine.runner.interrupt
    request = interrupt.request
    interrupt.request = lambda: raised.append("up") or request()  # type: ignore[method-assign]

    async def run() -> None:
        async_engine = AsyncLLMEngine(engine)
        for rid, lane in (("b-0", Lane.BATCH), ("i-0", Lane.INTERACTIVE)):
            async for _ in async_engine.generate(EngineRequest(rid, PROMPTS[0], SP, lane=lane)):
                pass
            raised.append(rid)
        await async_engine.shutdown()

    asyncio.run(run())
    assert raised == ["b-0", "up", "i-0"]

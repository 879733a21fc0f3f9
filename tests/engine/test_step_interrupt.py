"""A batch-only step gives way to interactive work at the next layer boundary (runner/interrupt.py): the
step is dropped as if it had not run, and run again later with the same result; steps holding interactive
work are never stopped."""

from __future__ import annotations

import pytest
from helpers.fused_step import bf16_engine

from edgeinfer.engine import kernels
from edgeinfer.engine.engine import LLMEngine
from edgeinfer.types import EngineRequest, SamplingParams
from edgeinfer.types.request import Lane

PROMPTS = [list(range(5, 45)), list(range(50, 61)), [7] * 23]
SP = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=1)


def _add(engine: LLMEngine, lane: Lane, tag: str = "") -> None:
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(EngineRequest(f"{lane}{tag}-{i}", prompt, SP, lane=lane))


def _drain(engine: LLMEngine, interrupt_at: set[int] = frozenset(), mid_layer: int | None = None):
    """Step to the end; at the steps numbered in `interrupt_at`, interactive work 'arrives': before the
    step (the flag set) or, with `mid_layer`, while the step's eager forward reaches that layer."""
    answers: dict[str, list[tuple[int, float]]] = {}
    step = 0
    hook = None
    while engine.has_unfinished_requests():
        if step in interrupt_at:
            if mid_layer is None:
                engine.runner.interrupt.request()
            else:
                layer = engine.model.model.layers[mid_layer]
                hook = layer.register_forward_pre_hook(lambda *_: engine.runner.interrupt.request())
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
    mid = _drain(engine, interrupt_at={0}, mid_layer=0)  # the tiny model has two layers
    assert engine.num_interrupted_steps == 5
    for i in range(len(PROMPTS)):
        assert again[f"batchagain-{i}"] == mid[f"batchmid-{i}"] == plain[f"batch-{i}"]


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

"""The fused decode step against the eager path it replaces, for any model an engine serves."""

from __future__ import annotations

import dataclasses
from typing import Any

from edgeinfer.engine.config import EngineConfig
from edgeinfer.engine.engine import LLMEngine
from edgeinfer.types import SamplingParams

Answers = list[tuple[list[int], list[float]]]


def bf16_engine(model: str, **overrides: Any) -> LLMEngine:
    """A bf16 engine whose products see the same rows in every run: no prefix cache (a second run's prompts
    would prefill their rest in fewer rows, which may cross from torch's GEMM to the kernel, sums in another
    order) and no step-time budget (it cuts prefills by measured speed, on a busy machine differently in
    each run)."""
    config = EngineConfig(
        model=model,
        dtype="bfloat16",
        num_kv_blocks=64,
        enable_prefix_caching=False,
        max_step_ms=None,
        shared_step_ms=None,
        batch_window_ms=0,
    )
    return LLMEngine(dataclasses.replace(config, **overrides))


def greedy_answers(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, together: bool) -> Answers:
    """Greedy tokens with their logprobs (chosen and top), one request at a time or all at once."""
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=3)
    done = engine.generate(prompts, sp) if together else [engine.generate([p], sp)[0] for p in prompts]
    out = []
    for c in done:
        lps = [lp for o in c.outputs for lp in o.logprobs]
        assert len(lps) == max_tokens
        out.append(([t.token_id for t in lps], [t.logprob for t in lps] + [p for t in lps for _, p in t.top]))
    return out


def assert_fused_step_decodes_as_eager(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> None:
    """The fused step takes every decode step (alone and batched), and the answers equal the eager path's
    bit for bit."""
    fused = engine.runner.fused
    assert fused is not None, "every layer of this model runs on our kernels: the fused step takes it"
    rows: list[int] = []

    def counted(ids, positions, meta, stop=None):
        rows.append(len(ids))
        return fused(ids, positions, meta, stop)

    engine.runner.fused = counted
    with_fused = [greedy_answers(engine, prompts, max_tokens, together) for together in (False, True)]
    assert rows.count(1) >= len(prompts) * (max_tokens - 1) and max(rows) == len(prompts)
    engine.runner.fused = None
    assert [greedy_answers(engine, prompts, max_tokens, together) for together in (False, True)] == with_fused

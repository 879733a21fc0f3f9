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


def greedy_answers(
    engine: LLMEngine,
    prompts: list[list[int]],
    max_tokens: int,
    together: bool,
    adapters: list[str | None] | None = None,
) -> Answers:
    """Greedy tokens with their logprobs (chosen and top), one request at a time or all at once; each
    prompt under its LoRA adapter in `adapters` (None: the base)."""
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=3)
    names = adapters or [None] * len(prompts)
    if together:
        done = engine.generate(prompts, sp, names)
    else:
        done = [engine.generate([p], sp, [n])[0] for p, n in zip(prompts, names, strict=True)]
    out = []
    for c in done:
        lps = [lp for o in c.outputs for lp in o.logprobs]
        assert len(lps) == max_tokens
        out.append(([t.token_id for t in lps], [t.logprob for t in lps] + [p for t in lps for _, p in t.top]))
    return out


def assert_fused_step_decodes_as_eager(
    engine: LLMEngine,
    prompts: list[list[int]],
    max_tokens: int,
    adapters: list[str | None] | None = None,
) -> None:
    """The fused step takes every decode step (alone and batched), those of adapter requests too, and the
    answers equal the eager path's bit for bit."""
    fused = engine.runner.fused
    assert fused is not None, "every layer of this model runs on our kernels: the fused step takes it"
    rows: list[int] = []
    adapter_steps: list[int] = []

    def counted(ids, positions, meta, stop=None, lora=None):
        rows.append(len(ids))
        if lora is not None:
            adapter_steps.append(len(ids))
        return fused(ids, positions, meta, stop, lora)

    engine.runner.fused = counted
    runs = (False, True)
    with_fused = [greedy_answers(engine, prompts, max_tokens, together, adapters) for together in runs]
    assert rows.count(1) >= len(prompts) * (max_tokens - 1) and max(rows) == len(prompts)
    if adapters is not None:  # each adapter request's decode steps alone, and the batch's
        with_adapter = sum(name is not None for name in adapters)
        assert adapter_steps.count(1) >= with_adapter * (max_tokens - 1)
        assert adapter_steps.count(len(prompts)) >= max_tokens - 1
    engine.runner.fused = None
    eager = [greedy_answers(engine, prompts, max_tokens, together, adapters) for together in runs]
    assert eager == with_fused

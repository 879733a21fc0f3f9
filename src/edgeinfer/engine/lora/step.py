"""One step's adapter work, laid out once per step: the step's adapter tokens grouped by adapter, and per
targeted module the arguments of a single `lora_add` call (kernels/lora.cpp) over every adapter of the
step that targets it. `torch_delta` computes the same delta with torch ops: the path where the kernels
cannot be built, and the kernel's reference in tests."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from edgeinfer.engine.lora.weights import LoraWeights, ModuleLora

# An adapter of the step and its rows of the flat batch, as [start, end) ranges.
Group = tuple[LoraWeights, Sequence[tuple[int, int]]]


@dataclass(frozen=True)
class ModuleStep:
    """The adapters of the step that target one module, each with its segment of the step's `rows`."""

    loras: tuple[ModuleLora, ...]
    segments: tuple[tuple[int, int], ...]
    a: list[torch.Tensor]
    b: list[torch.Tensor]
    plan: torch.Tensor  # int64: per adapter its segment's start and end, then `ModuleLora.plan()`


@dataclass(frozen=True)
class StepPlan:
    rows: torch.Tensor  # int64: the flat batch's rows of every adapter, one adapter's after another
    modules: dict[tuple[int, str], ModuleStep]


def plan_step(groups: Sequence[Group]) -> StepPlan:
    """The step's layout: each adapter's rows one segment of `rows`, each module's call over its adapters."""
    rows: list[int] = []
    segments: list[tuple[LoraWeights, tuple[int, int]]] = []
    for weights, ranges in groups:
        start = len(rows)
        for lo, hi in sorted(ranges):
            rows.extend(range(lo, hi))
        segments.append((weights, (start, len(rows))))
    by_module: dict[tuple[int, str], list[tuple[ModuleLora, tuple[int, int]]]] = {}
    for weights, segment in segments:
        for key, lora in weights.modules.items():
            by_module.setdefault(key, []).append((lora, segment))
    modules = {key: _module_step(items) for key, items in by_module.items()}
    return StepPlan(torch.tensor(rows, dtype=torch.long), modules)


def _module_step(items: list[tuple[ModuleLora, tuple[int, int]]]) -> ModuleStep:
    plan = [v for lora, (start, end) in items for v in (start, end, *lora.plan())]
    return ModuleStep(
        loras=tuple(lora for lora, _ in items),
        segments=tuple(segment for _, segment in items),
        a=[lora.a for lora, _ in items],
        b=[lora.b for lora, _ in items],
        plan=torch.tensor(plan, dtype=torch.long),
    )


def torch_delta(out: torch.Tensor, x: torch.Tensor, rows: torch.Tensor, step: ModuleStep) -> None:
    """`lora_add` in torch ops: per adapter a gather, a pair of matmuls per slice and a scatter-add."""
    rows = rows.to(x.device)
    for lora, (start, end) in zip(step.loras, step.segments, strict=True):
        index = rows[start:end]
        h = x[index].to(lora.a.dtype) @ lora.a.T
        for s in lora.slices:
            delta = h[:, s.r0 : s.r0 + lora.rank] @ lora.bt(s)
            out[:, s.lo : s.hi].index_add_(0, index, delta.to(out.dtype))

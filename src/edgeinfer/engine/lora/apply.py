"""Adding the adapters' deltas to one step's flat batch.

Each targeted linear module gets a forward hook (installed while any adapter is resident). For a step,
`begin` groups the flat batch's rows by adapter (the base's rows are in no group); the hook then adds,
for each adapter of the step, `x[rows] @ A.T @ B.T * scale` to the module's output at those rows, beside
whatever product the base runs (bf16 GEMV, int8/int4 kernels, torch): a segmented LoRA product, one pair of
small matmuls per adapter and module whatever the number of its requests. The fused C++ decode step and
a compiled graph never call the modules, so the runner runs steps with adapter rows eagerly."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from edgeinfer.engine.lora.weights import LoraSlice, LoraWeights


@dataclass(frozen=True)
class StepGroup:
    """One adapter's rows of the step: a slice when they are contiguous (no gather), else an index."""

    weights: LoraWeights
    rows: slice | torch.Tensor


class LoraRuntime:
    """The hooks on a model's targeted modules and the current step's groups."""

    def __init__(self, modules: dict[tuple[int, str], nn.Module]) -> None:
        self._modules = modules
        self._handles: list[RemovableHandle] = []
        self.groups: list[StepGroup] = []

    @property
    def installed(self) -> bool:
        return bool(self._handles)

    def install(self) -> None:
        if not self._handles:
            self._handles = [m.register_forward_hook(self._hook(key)) for key, m in self._modules.items()]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self.groups = []

    def begin(self, rows_by_adapter: dict[str, tuple[LoraWeights, list[tuple[int, int]]]]) -> bool:
        """Set the step's groups from each adapter's row ranges; False when no row has an adapter."""
        self.groups = [StepGroup(w, _rows(ranges)) for w, ranges in rows_by_adapter.values()]
        return bool(self.groups)

    def _hook(self, key: tuple[int, str]) -> Callable[..., torch.Tensor | None]:
        # `out` is the module's own fresh result (every linear of ours returns a new tensor), so the
        # deltas are added to it in place
        def hook(module: nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> torch.Tensor | None:
            if not self.groups:
                return None
            x = args[0]
            for g in self.groups:
                lora = g.weights.modules.get(key)
                if lora is not None:
                    _add_delta(out, x, g.rows, lora.a, lora.slices)
            return out

        return hook


def _add_delta(
    out: torch.Tensor,
    x: torch.Tensor,
    rows: slice | torch.Tensor,
    a: torch.Tensor,
    slices: tuple[LoraSlice, ...],
) -> None:
    if isinstance(rows, torch.Tensor) and rows.device != x.device:
        rows = rows.to(x.device)
    h = x[rows].to(a.dtype) @ a.T  # [n, sum of ranks]
    for s in slices:
        delta = (h[:, s.r0 : s.r1] @ s.b.T).to(out.dtype)
        if isinstance(rows, slice):
            out[rows, s.lo : s.hi].add_(delta)
        else:
            out[:, s.lo : s.hi].index_add_(0, rows, delta)


def _rows(ranges: Iterable[tuple[int, int]]) -> slice | torch.Tensor:
    merged: list[list[int]] = []
    for start, end in sorted(ranges):
        if merged and merged[-1][1] == start:
            merged[-1][1] = end
        else:
            merged.append([start, end])
    if len(merged) == 1:
        return slice(merged[0][0], merged[0][1])
    return torch.tensor([r for start, end in merged for r in range(start, end)], dtype=torch.long)

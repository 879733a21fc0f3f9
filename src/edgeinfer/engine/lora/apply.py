"""Adding the adapters' deltas to one step's flat batch.

Each targeted linear module gets a forward hook (installed while any adapter is resident). For a step,
`begin` takes the flat batch's rows grouped by adapter (the base's rows are in no group) and lays out
each module's work once (step.py); each hook then adds every adapter's `x[rows] @ A.T @ B.T * scale` to
the module's output at its rows in one `lora_add` call (kernels/lora.cpp), beside whatever product the
base runs (bf16 GEMV, int8/int4 kernels, torch): a segmented LoRA product. The fused C++ decode step
never calls the modules: it takes the step's plan and makes the same `lora_add` calls itself
(model/fused_decode.py). A compiled graph does neither, so the runner runs its steps with adapter rows
eagerly."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from edgeinfer.engine import kernels
from edgeinfer.engine.kernels import ops
from edgeinfer.engine.lora.step import Group, StepPlan, plan_step, torch_delta
from edgeinfer.engine.lora.weights import LoraWeights

log = logging.getLogger(__name__)
_Key = tuple[tuple[int, tuple[tuple[int, int], ...]], ...]


class LoraRuntime:
    """The hooks on a model's targeted modules and the current step's plan."""

    def __init__(self, modules: dict[tuple[int, str], nn.Module], dtype: torch.dtype, kernel: bool) -> None:
        self._modules = modules
        self._handles: list[RemovableHandle] = []
        self.plan: StepPlan | None = None
        self._dtype = dtype  # the adapters': inputs and outputs of another take the torch ops
        self._kernel = kernel
        # the last plan, by the identity of its adapters and their rows (a decode step's is usually its
        # last step's), with the adapters themselves: held, their ids cannot name another adapter
        self._last: tuple[_Key, list[LoraWeights], StepPlan] | None = None

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
        self.plan = self._last = None

    def begin(self, rows_by_adapter: dict[str, Group]) -> StepPlan | None:
        """Set the step's plan from each adapter's row ranges and return it; None when no row has an
        adapter. A step with the last step's adapters on the same rows gets the same plan object."""
        groups = list(rows_by_adapter.values())
        if not groups:
            self.plan = self._last = None  # nor adapter weights held past their last step
            return None
        key = tuple((id(w), tuple(ranges)) for w, ranges in groups)
        if self._last is None or self._last[0] != key:
            self._last = (key, [w for w, _ in groups], plan_step(groups))
        self.plan = self._last[2]
        return self.plan

    def _hook(self, key: tuple[int, str]) -> Callable[..., None]:
        # `out` is the module's own fresh result (every linear of ours returns a new tensor), so the
        # deltas are added to it in place
        def hook(module: nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
            plan = self.plan
            step = plan.modules.get(key) if plan is not None else None
            if step is None:
                return
            x = args[0]
            if self._kernel and x.dtype == out.dtype == self._dtype:
                ops.lora_add(out, x, plan.rows, step.a, step.b, step.plan)
            else:
                torch_delta(out, x, plan.rows, step)

        return hook


def kernel_available(model: nn.Module) -> bool:
    """Whether `lora_add` serves this model: our CPU kernels build here and the model runs on the CPU."""
    if next(model.parameters()).device.type != "cpu":
        return False
    try:
        kernels.load()
    except kernels.KernelBuildError as e:
        log.info("LoRA deltas through torch ops: %s", e)
        return False
    return True

"""Stopping a batch-only step when interactive work arrives, within the layer it is in.

A step that holds batch-lane work only is `armed`; an interactive request arriving meanwhile (from the
server's thread) sets the flag, and the model raises `StepInterrupted` at its next check (the eager forward
through pre-hooks, the fused C++ step through the flag tensor it reads between layers). The engine then
drops the step as if it had not run: nothing is sampled, no request advances, and the KV it wrote is
written again, identically, when the step is run anew. The newcomer waits for a fraction of one layer of
the step in flight rather than the whole step, so batch steps may be long (a fuller batch per read of the
weights) without delaying first tokens.

The eager forward is checked before every module of a layer that holds weights (its projections, norms and
expert stacks), not only between layers: a long batch prefill spends tens of milliseconds in one layer,
most of them in one or two products. The checks are hooks installed only while a step is armed, so that
every other step keeps PyTorch's hook-free call path.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle


class StepInterrupted(Exception):
    """The step in flight was dropped for interactive work."""


class StepInterrupt:
    def __init__(self) -> None:
        # Read by the fused step between layers; written by another thread (a lone int32: no torn value).
        self.flag = torch.zeros(1, dtype=torch.int32)
        self._requested = False
        self._armed = False
        self._watched: list[nn.Module] = []
        self._hooks: list[RemovableHandle] = []

    @property
    def armed(self) -> bool:
        return self._armed

    @armed.setter
    def armed(self, on: bool) -> None:
        if on and not self._armed:
            self._hooks = [m.register_forward_pre_hook(self._check) for m in self._watched]
        elif not on:
            for hook in self._hooks:
                hook.remove()
            self._hooks = []
        self._armed = on

    def request(self) -> None:
        """Interactive work arrived: stop the step in flight if it is a batch-only one."""
        self._requested = True
        self.flag[0] = 1

    def clear(self) -> None:
        """Before the engine takes in new requests: what arrived until now is seen by the next step."""
        self._requested = False
        self.flag[0] = 0

    def stop_flag(self) -> torch.Tensor | None:
        """The flag for the fused step to read between layers while a step is armed (else None)."""
        return self.flag if self.armed else None

    def _check(self, *_: object) -> None:
        if self._requested:
            raise StepInterrupted

    def watch(self, layers: nn.ModuleList) -> None:
        """Where the armed eager forward checks: before each layer and each module in it that holds
        weights; a module the layers share (a rotary table) is watched once."""
        seen: set[int] = set()
        for layer in layers:
            for module in (layer, *filter(_holds_weights, layer.modules())):
                if id(module) not in seen:
                    seen.add(id(module))
                    self._watched.append(module)


def _holds_weights(module: nn.Module) -> bool:
    """A leaf of the layer with weights of its own: a projection (plain or prepared), a norm, experts."""
    return next(module.children(), None) is None and (
        next(module.parameters(recurse=False), None) is not None
        or any(b.dim() >= 2 for b in module.buffers(recurse=False))
    )

"""Stopping a batch-only step when interactive work arrives, at the next layer boundary.

A step that holds batch-lane work only is `armed`; an interactive request arriving meanwhile (from the
server's thread) sets the flag, and the model's next layer raises `StepInterrupted` (the eager layers
through a pre-hook, the fused C++ step through the flag tensor it reads between layers). The engine then
drops the step as if it had not run: nothing is sampled, no request advances, and the KV it wrote is
written again, identically, when the step is run anew. The newcomer waits for one layer of the step in
flight rather than the whole step, so batch steps may be long (a fuller batch per read of the weights)
without delaying first tokens.
"""

from __future__ import annotations

import torch
from torch import nn


class StepInterrupted(Exception):
    """The step in flight was dropped for interactive work."""


class StepInterrupt:
    def __init__(self) -> None:
        # Read by the fused step between layers; written by another thread (a lone int32: no torn value).
        self.flag = torch.zeros(1, dtype=torch.int32)
        self.armed = False
        self._requested = False

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

    def check(self) -> None:
        if self.armed and self._requested:
            raise StepInterrupted

    def watch(self, layers: nn.ModuleList) -> None:
        """Check before each of the model's layers (its eager forward)."""
        for layer in layers:
            layer.register_forward_pre_hook(lambda *_: self.check())

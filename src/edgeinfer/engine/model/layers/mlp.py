"""Gated MLP with gate and up projections fused into one matmul."""

from __future__ import annotations

import torch
from torch import nn

from edgeinfer.engine.model.layers.activation import get_activation


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)); `gate_up_proj` holds [gate; up] stacked on the output dim."""

    def __init__(self, hidden: int, intermediate: int, act: str, bias: bool = False) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.act = get_activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(self.act(gate) * up)

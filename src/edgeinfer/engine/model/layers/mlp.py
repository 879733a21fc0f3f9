"""Gated MLP with gate and up projections fused into one matmul."""

from __future__ import annotations

import torch
from torch import nn

from edgeinfer.engine.kernels import ops
from edgeinfer.engine.model.layers.activation import get_activation
from edgeinfer.engine.model.layers.kernel_ops import takes_kernel

# Activations our one-call `gated_act` knows (decode_ops.cpp), by HF name -> its code
ACT_CODES = {"silu": 0, "swish": 0, "gelu_pytorch_tanh": 1, "gelu_new": 1}


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)); `gate_up_proj` holds [gate; up] stacked on the output dim."""

    def __init__(self, hidden: int, intermediate: int, act: str, bias: bool = False) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.act = get_activation(act)
        self.act_code = ACT_CODES.get(act)  # for our `gated_act` (model.decode_ops.use_decode_ops)
        self.kernel_elements = 0  # our one-call `gated_act` up to this size (layers/kernel_ops.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.act_code is not None and gate_up.dim() == 2 and takes_kernel(self, gate_up):
            return self.down_proj(ops.gated_act(gate_up, self.act_code))
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.down_proj(self.act(gate) * up)

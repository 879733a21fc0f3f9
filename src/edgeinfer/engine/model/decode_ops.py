"""Our one-call decode ops (kernels/decode_ops.cpp) switched on for a model's layers; the runner also sets
its attention backend's `decode_ops`. The switch lives with the layers it flips, so the kernels room
imports no model.

A one-sequence decode step of a small model costs more in calling ops than in their arithmetic. With
the ops on, each RMSNorm of bf16 rows is one call instead of ~6, each rotary embedding one instead of
~8, the MLP's `act(gate) * up` one instead of 3, and each attention layer of a one-sequence step over a
plain bf16 cache one call (write K/V, attend over the blocks in place) instead of ~15 with the gather.
Only models whose layers already run on our kernels take them (the engine decides:
`loading.uses_cpu_gemv`), so `cpu_gemv=False` keeps the whole step on torch's ops. A compiled graph
(`--compile`) traces the torch ops instead, which inductor fuses itself.
"""

from __future__ import annotations

from torch import nn

from edgeinfer.engine.kernels.bf16 import GemvLinear
from edgeinfer.engine.kernels.limits import KernelLimits
from edgeinfer.engine.kernels.lossless import LosslessLinear
from edgeinfer.engine.model.layers.mlp import GatedMLP
from edgeinfer.engine.model.layers.norm import RMSNorm
from edgeinfer.engine.model.layers.rotary import RotaryEmbedding
from edgeinfer.engine.model.moe import SparseMoeBlock

_MODULES = (RMSNorm, RotaryEmbedding, GatedMLP)  # those with a `kernel_elements` switch


def use_decode_ops(model: nn.Module, limits: KernelLimits) -> None:
    """Turn the ops on for the model's norms, rotary embeddings and gated MLPs, and our one-call MoE block
    for its sparse MoE blocks, within this CPU's `limits`, which its bf16 linear layers take too (call
    after `kernels.load()`)."""
    for module in model.modules():
        if isinstance(module, (GemvLinear, LosslessLinear)):
            module.max_rows = limits.bf16_gemv_rows
        elif isinstance(module, _MODULES):
            module.kernel_elements = limits.decode_op_elements
        elif isinstance(module, SparseMoeBlock):
            module.use_kernel(limits)

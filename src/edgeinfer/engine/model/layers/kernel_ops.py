"""When a layer hands its small bf16 ops to our one-call CPU kernels (quant/kernels/decode_ops.cpp).

The kernels remove the cost of calling a dozen torch ops, which is what a decode step's norms, rotations
and activations mostly cost. Past a few thousand values the arithmetic dominates, and torch's vectorised
elementwise kernels (parallel across threads) are faster than our plain loops: a 128-token prefill with
the kernels on for every size was ~30 % slower (Gemma 3 270M, 2 threads). So only inputs up to
MAX_ELEMENTS values take them: a decode step of a few sequences (Gemma's q-norm at one sequence: 1,024).
"""

from __future__ import annotations

import torch
from torch import nn

MAX_ELEMENTS = 16_384


def takes_kernel(module: nn.Module, x: torch.Tensor) -> bool:
    """Whether `module` (switched on by `kernels.decode.use_decode_ops`) runs `x` through our kernel; a
    compiled graph keeps the torch ops, which inductor fuses itself."""
    return (
        getattr(module, "kernel", False)
        and x.dtype == torch.bfloat16
        and x.numel() <= MAX_ELEMENTS
        and not torch.compiler.is_compiling()
    )

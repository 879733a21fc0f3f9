"""When a layer hands its bf16 norms, rotations and activations to our CPU kernels (decode_ops.cpp): a
layer switched on by `model.decode_ops.use_decode_ops` carries the largest input the kernels take on
this CPU (`kernel_elements`, kernels/limits.py says why there is one); 0 keeps the torch ops."""

from __future__ import annotations

import torch
from torch import nn


def takes_kernel(module: nn.Module, x: torch.Tensor) -> bool:
    """Whether `module` runs `x` through our kernel; a compiled graph keeps the torch ops, which inductor
    fuses itself."""
    return (
        0 < x.numel() <= module.kernel_elements
        and x.dtype == torch.bfloat16
        and not torch.compiler.is_compiling()
    )

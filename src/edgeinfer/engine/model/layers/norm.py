"""RMSNorm in the two conventions the families use."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from edgeinfer.engine.kernels import ops
from edgeinfer.engine.model.layers.kernel_ops import takes_kernel


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 with one fused kernel.

    `unit_offset=True` is Gemma's convention: the stored weight is a delta and the scale is `1 + w`,
    applied before casting back (Llama casts first, then multiplies; the difference shows in bf16).
    `kernel_elements` (set by `model.decode_ops.use_decode_ops`): bf16 inputs up to that size take our
    one-call `rms_norm`, with the same roundings, instead of the ~6 torch ops below (layers/kernel_ops.py).
    """

    def __init__(self, dim: int, eps: float, unit_offset: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.unit_offset = unit_offset
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))
        self._scale: tuple[int, torch.Tensor] | None = None
        self.kernel_elements = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if takes_kernel(self, x) and self.takes_kernel_weight():
            weight = self.kernel_weight()
            return ops.rms_norm(x.contiguous(), weight, self.eps, not self.unit_offset)
        shape = (x.shape[-1],)
        if self.unit_offset:
            return F.rms_norm(x.float(), shape, self._fp32_scale(), self.eps).type_as(x)
        return self.weight * F.rms_norm(x.float(), shape, None, self.eps).type_as(x)

    def takes_kernel_weight(self) -> bool:
        """Whether our kernel rounds as this norm does (a non-bf16 weight would make the torch form's
        product another dtype)."""
        return self.unit_offset or self.weight.dtype == torch.bfloat16

    def kernel_weight(self) -> torch.Tensor:
        """The weight our `rms_norm` takes: Gemma's fp32 `1 + w`, else the weight itself."""
        return self._fp32_scale() if self.unit_offset else self.weight.detach()

    def _fp32_scale(self) -> torch.Tensor:
        if torch.compiler.is_compiling():  # a compiled graph fuses `1 + w` into the norm
            return 1.0 + self.weight.float()
        # `1 + w` in fp32, rebuilt only when the weight changes (its version counter moves on load).
        version = self.weight._version
        if self._scale is None or self._scale[0] != version:
            self._scale = (version, 1.0 + self.weight.detach().float())
        return self._scale[1]

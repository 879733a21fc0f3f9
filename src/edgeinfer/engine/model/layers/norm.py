"""RMSNorm in the two conventions the families use."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32.

    `unit_offset=True` is Gemma's convention: the stored weight is a delta and the scale is `1 + w`,
    applied before casting back (Llama casts first, then multiplies; the difference shows in bf16).
    """

    def __init__(self, dim: int, eps: float, unit_offset: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.unit_offset = unit_offset
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (xf * (1.0 + self.weight.float())).type_as(x)
        return self.weight * xf.type_as(x)

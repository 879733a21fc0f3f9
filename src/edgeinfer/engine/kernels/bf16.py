"""Float models' linear layers through `bf16_gemv` (bf16_gemv.cpp, bf16_tiles.cpp) where it outruns torch:
products of few rows (decode steps), up to the CPU's limit (limits.py says which), one summation order
per output whatever the row count, so a sequence's logits do not depend on the batch it decodes in.
Wider products (prefill) keep torch's GEMM (timings: docs/engine.md § Matmuls on CPU).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from edgeinfer.engine.kernels import ops


class GemvLinear(nn.Linear):
    """`nn.Linear` whose bf16 products of at most `max_rows` rows run through `bf16_gemv`; it shares the
    weight (and bias) Parameter of the layer it replaces, so tied weights stay tied."""

    # No product takes the kernel until the engine sets its runtime's limit (model/decode_ops.py). A
    # class default, so the prepared-form cache does not store it: a cached model takes the limit of the
    # process that loads it.
    max_rows: int = 0

    @classmethod
    def from_linear(cls, linear: nn.Linear, max_rows: int = 0) -> GemvLinear:
        layer = cls(linear.in_features, linear.out_features, bias=False, device="meta")
        layer.weight = linear.weight
        layer.bias = linear.bias
        if max_rows:
            layer.max_rows = max_rows
        return layer

    def uses_kernel(self, x: torch.Tensor) -> bool:
        rows = x.numel() // self.in_features if self.in_features else 0
        return x.dtype == self.weight.dtype == torch.bfloat16 and 0 < rows <= self.max_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.uses_kernel(x):
            return F.linear(x, self.weight, self.bias)
        y = ops.bf16_gemv(x.reshape(-1, self.in_features), self.weight)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def forward_into(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`forward` for 2-D `x` into `out` (`[M, out_features]`, fp32 or bf16); through the kernel the
        fp32 sums land in an fp32 `out` unrounded."""
        if not self.uses_kernel(x):
            return out.copy_(F.linear(x, self.weight, self.bias))
        ops.bf16_gemv_out(x, self.weight, out)
        if self.bias is not None:
            out.add_(self.bias)
        return out


def use_bf16_gemv(model: nn.Module) -> int:
    """Replace the model's bf16 `nn.Linear` layers (on CPU) by `GemvLinear` in place (call `kernels.load()`
    first); returns how many."""
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and fits(child.weight):
                setattr(parent, name, GemvLinear.from_linear(child))
                swapped += 1
    return swapped


def fits(weight: torch.Tensor) -> bool:
    return weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and weight.is_contiguous()

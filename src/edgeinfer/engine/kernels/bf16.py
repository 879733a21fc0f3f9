"""Float models' linear layers through `bf16_gemv` (bf16_gemv.cpp, bf16_tiles.cpp) where it outruns torch.

On AVX-512 CPUs with AVX512-BF16 and no AMX, products of up to 64 rows (every decode step of up to
`max_num_seqs` = 64 sequences) take the kernel: register tiles of `vdpbf16ps` with the next weight tile
prefetched into L2 (bf16_tiles.cpp), one summation order per output whatever the row count, so a
sequence's logits do not depend on the batch it decodes in. There the weight stream is what a product of
few rows costs, and the tiles keep it at the memory bandwidth where torch's GEMM does not. Wider products
(prefill) are bound by arithmetic and keep torch's GEMM, which blocks for the caches and is as fast there
or faster (timings: docs/engine.md § Matmuls on CPU).

Elsewhere the decode-step loops of bf16_gemv.cpp take the few-row products and torch's GEMM the wider ones:
- with AMX, oneDNN's AMX GEMM overtakes the loops from 4 rows, so up to 2;
- AVX-512 without BF16 (weights widened to fp32): up to 16; AVX2 only (two activation rows a pass, half
  the registers): up to 4.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from edgeinfer.engine.kernels import AVX512_FLAGS, cpu_flags, ops


def _gemv_rows(flags: frozenset[str]) -> int:
    """Products of up to this many rows take the kernel (module docstring)."""
    avx512 = flags >= AVX512_FLAGS
    if "amx_bf16" in flags:
        return 2
    if avx512 and "avx512_bf16" in flags:
        return 64
    return 16 if avx512 else 4


GEMV_ROWS = _gemv_rows(cpu_flags())


class GemvLinear(nn.Linear):
    """`nn.Linear` whose bf16 products of at most GEMV_ROWS rows run through `bf16_gemv`; it shares the
    weight (and bias) Parameter of the layer it replaces, so tied weights stay tied."""

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> GemvLinear:
        layer = cls(linear.in_features, linear.out_features, bias=False, device="meta")
        layer.weight = linear.weight
        layer.bias = linear.bias
        return layer

    def uses_kernel(self, x: torch.Tensor) -> bool:
        rows = x.numel() // self.in_features if self.in_features else 0
        return x.dtype == self.weight.dtype == torch.bfloat16 and 0 < rows <= GEMV_ROWS

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
    """Replace the model's bf16 `nn.Linear` layers (on CPU) by `GemvLinear` in place (call
    `kernels.load()` first); returns how many."""
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and fits(child.weight):
                setattr(parent, name, GemvLinear.from_linear(child))
                swapped += 1
    return swapped


def fits(weight: torch.Tensor) -> bool:
    return weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and weight.is_contiguous()

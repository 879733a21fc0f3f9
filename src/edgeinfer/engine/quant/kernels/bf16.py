"""Float models' linear layers through `bf16_gemv` (bf16_gemv.cpp) when a product has few rows.

A decode step of a few sequences multiplies every weight by a few activation rows; there torch's bf16
GEMM reaches a fraction of the memory bandwidth and our kernel streams the weight as stored. Wider
products (prefill, batched decode) keep torch's GEMM, which blocks for the cache. Where it crosses over
depends on the CPU. Intel Xeon with AMX, 1 thread (CPU time, loaded machine) at 1 / 2 / 4 / 8 rows:
4096 x 640 0.10 / 0.20 / 0.37 / 0.83 ms, torch 0.27 / 0.26 / 0.38 / 0.58; 640 x 2048 0.038 / 0.073 /
0.16 / 0.29, torch 0.14 / 0.14 / 0.16 / 0.22; the 262k x 640 Gemma lm_head 31.7 / 44.5 / 52.4 / 62.5,
torch 39.9 / 45.4 / 48.2 / 50.4. AMD EPYC (AVX512-BF16, no AMX), 2 threads, at 4 / 8 rows: lm_head
10.1 / 15.4 ms, torch 13.9 / 16.7; 4096 x 640 0.098 / 0.151, torch 0.114 / 0.123; 640 x 2048 0.056 /
0.086, torch 0.061 / 0.070. So up to 4 rows take the kernel, 2 where the CPU has AMX.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from edgeinfer.engine.quant.kernels import cpu_flags

# products of up to this many rows take the kernel
GEMV_ROWS = 2 if "amx_bf16" in cpu_flags() else 4


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
        y = torch.ops.edgeinfer_cpu.bf16_gemv(x.reshape(-1, self.in_features), self.weight)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def forward_into(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`forward` for 2-D `x` into `out` (`[M, out_features]`, fp32 or bf16); through the kernel the
        fp32 sums land in an fp32 `out` unrounded."""
        if not self.uses_kernel(x):
            return out.copy_(F.linear(x, self.weight, self.bias))
        torch.ops.edgeinfer_cpu.bf16_gemv_out(x, self.weight, out)
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

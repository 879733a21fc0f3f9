"""Float models' linear layers through `bf16_gemv` (bf16_gemv.cpp, bf16_tiles.cpp) where it outruns torch.

On AVX-512 CPUs with AVX512-BF16 and no AMX, products of up to 64 rows (every decode step of up to
`max_num_seqs` = 64 sequences) take the kernel: register tiles of `vdpbf16ps` with the next weight tile
prefetched into L2 (bf16_tiles.cpp), one summation order per output whatever the row count, so a
sequence's logits do not depend on the batch it decodes in. AMD EPYC (Zen 4), 2 threads, 2026-12-04,
kernel / torch's GEMM: the 262k x 640 Gemma lm_head at 1 / 8 / 16 / 32 / 128 rows 10.3-10.8 / 10.5 / 16.8
/ 31.0 / 115 ms against 19.7 / 24.5 / 31.3 / 43-49 / 134-144 ms. Wider products (prefill) keep torch's
GEMM, which blocks for the caches: Gemma's layer shapes at 128-512 rows 0.87-1.05x its speed in the tiles,
all-MiniLM's (384 inputs, 384-1536 outputs) at 512 rows 0.65-0.75x.

Elsewhere the decode-step loops of bf16_gemv.cpp take the few-row products and torch's GEMM the wider ones:
- Intel Xeon with AMX, 1 thread (an older form of the kernel, two activation rows a pass) at 1 / 2 / 4 /
  8 rows: 4096 x 640 0.10 / 0.20 / 0.37 / 0.83 ms, torch 0.27 / 0.26 / 0.38 / 0.58; the lm_head 31.7 /
  44.5 / 52.4 / 62.5, torch 39.9 / 45.4 / 48.2 / 50.4: oneDNN's AMX GEMM wins from 4 rows, so 2 there.
- AVX-512 without BF16 (weights widened to fp32): 16; AVX2 only (two activation rows a pass, half the
  registers): 4, as measured on those CPUs before.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from edgeinfer.engine.quant.kernels import AVX512_FLAGS, cpu_flags


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

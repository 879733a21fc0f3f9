"""fp8 e4m3 weights with per-output-channel scales (W8A16), compressed-tensors `float-quantized`.

CPUs here have no fp8 arithmetic (`torch._scaled_mm` runs, far slower than bf16), so the weight is widened
to bf16 with an exact bit trick and multiplied in bf16; the per-channel scale is applied to the output.
Relative error per weight: at most 2**-4 (3 mantissa bits, round to nearest) in e4m3's normal range.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from edgeinfer.engine.quant.base import PreparedWeight, ct_args, register_weight_method
from edgeinfer.engine.quant.channelwise import ChannelwiseMethod
from edgeinfer.engine.quant.packing import fp8_to_bf16

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row scaled e4m3: `[..., K]` -> (float8 `[..., K]`, fp32 scale `[..., 1]`), row amax maps to 448."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = (xf / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


@register_weight_method("fp8")
class Fp8Method(ChannelwiseMethod):
    """e4m3 weights, fp32 per-channel scales; activations stay in the serving dtype."""

    name = "fp8"
    checkpoint_format = "float-quantized"
    storage_dtype = torch.float8_e4m3fn

    def quantize_rows(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_rows_fp8(x)

    def widen(self, q: torch.Tensor) -> torch.Tensor:
        return fp8_to_bf16(q)

    def kernel_for(self, weight: PreparedWeight, num_tokens: int) -> str:
        return "dequant"

    def apply(self, weight: PreparedWeight, x: torch.Tensor) -> torch.Tensor:
        q, scale = weight.tensors["weight"], weight.tensors["weight_scale"]
        rows = max(1, _WIDEN_ELEMS // weight.in_features)
        if weight.out_features <= rows:
            return _widened_linear(x, q, scale)
        # big matrices (lm_head) are widened a row block at a time, so the bf16 copy stays in cache
        out = torch.empty(x.shape[0], weight.out_features, dtype=x.dtype, device=x.device)
        for s in range(0, weight.out_features, rows):
            out[:, s : s + rows] = _widened_linear(x, q[s : s + rows], scale[s : s + rows])
        return out

    def scheme(self) -> dict[str, Any]:
        return {
            "format": self.checkpoint_format,
            "weights": ct_args(num_bits=8, type="float", symmetric=True, strategy="channel"),
            "input_activations": None,
        }


_WIDEN_ELEMS = 1 << 20  # weights widened per block (2 MB of bf16)


def _widened_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    w = fp8_to_bf16(q)
    if x.dtype != torch.bfloat16:
        w = w.to(x.dtype)  # exact: every e4m3 value is a bf16 value
    return (F.linear(x, w).float() * scale).to(x.dtype)

"""int4 weights, group-wise asymmetric (W4A16), compressed-tensors `pack-quantized`.

Each group of `group_size` consecutive inputs of a row has a bf16 scale and a 4-bit zero point:
`w ~= (q - zp) * scale` with `q, zp` in [0, 15]. The group range is widened to include 0 (as
compressed-tensors' min-max observer does), so every weight is within half a step, `scale / 2`, of its grid.

On CPU the runtime form is the layout of torch's fused `_weight_int4pack_mm_for_cpu` kernel, which
dequantizes in registers; that layout depends on the CPU's vector width, so it is rebuilt at load and never
saved. The kernel computes `(q - 8) * scale + zero`; `zero = (8 - zp) * scale` is rounded to bf16, which
adds at most `scale / 32` (|8 - zp| <= 8, bf16 rounds to within 2^-8 relative).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from edgeinfer.engine.quant.base import (
    PreparedWeight,
    QuantizationError,
    WeightMethod,
    ct_args,
    register_weight_method,
)
from edgeinfer.engine.quant.packing import (
    bf16_round_up,
    int32_to_nibbles,
    nibbles_to_int32,
    pack_nibbles,
    pack_rows_int32,
    unpack_nibbles,
    unpack_rows_int32,
)

GROUP_SIZES = (32, 64, 128)
_CPU_KERNEL_GROUPS = (32, 64, 128, 256)


@register_weight_method("int4")
class Int4Method(WeightMethod):
    """Group-wise asymmetric 4-bit weights, two per byte."""

    name = "int4"
    checkpoint_format = "pack-quantized"

    def __init__(self, group_size: int = 128) -> None:
        if group_size not in GROUP_SIZES:
            raise QuantizationError(f"int4 group_size must be one of {GROUP_SIZES}, got {group_size}")
        self.group_size = group_size

    def options(self) -> dict[str, Any]:
        return {"group_size": self.group_size}

    # --- float <-> unpacked <-> state ------------------------------------------------------------
    def quantize(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        if weight.dim() < 2:
            raise QuantizationError(f"int4 quantizes matrices, got shape {tuple(weight.shape)}")
        k = weight.shape[-1]
        if k % self.group_size:
            raise QuantizationError(
                f"int4: in_features {k} is not a multiple of group_size {self.group_size}"
            )
        groups = weight.float().unflatten(-1, (k // self.group_size, self.group_size))
        lo = groups.amin(-1).clamp(max=0)
        hi = groups.amax(-1).clamp(min=0)
        # a scale rounded up keeps [lo, hi] inside the 16-step grid: no value is clamped by more than s/2
        scale = bf16_round_up((hi - lo) / 15)
        scale = torch.where(scale == 0, torch.ones_like(scale), scale)
        s = scale.float()  # quantize against the stored (rounded) scale
        zero = torch.round(-lo / s).clamp_(0, 15)
        q = torch.round(groups / s.unsqueeze(-1)).add_(zero.unsqueeze(-1)).clamp_(0, 15)
        unpacked = {"q": q.flatten(-2).to(torch.uint8), "zero": zero.to(torch.uint8), "scale": scale}
        return self.pack(unpacked)

    def pack(self, unpacked: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        q = unpacked["q"]
        shape = torch.tensor(q.shape[-2:], dtype=torch.int32).expand(*q.shape[:-2], 2).contiguous()
        return {
            "weight_packed": nibbles_to_int32(pack_nibbles(q)),
            "weight_scale": unpacked["scale"].to(torch.bfloat16),
            "weight_zero_point": pack_rows_int32(unpacked["zero"]),
            "weight_shape": shape,
        }

    def unpack(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        self.check_state(state)
        q = unpack_nibbles(int32_to_nibbles(state["weight_packed"]))
        scale = state["weight_scale"]
        rows, k = q.shape[-2], q.shape[-1]
        if scale.shape[-2:] != (rows, k // self.group_size) or k % self.group_size:
            raise QuantizationError(
                f"int4 state: weight_scale {tuple(scale.shape)} does not fit a {rows}x{k} weight "
                f"with group_size {self.group_size}"
            )
        zero = unpack_rows_int32(state["weight_zero_point"], rows)
        return {"q": q, "zero": zero, "scale": scale}

    def dequantize(self, state: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        u = self.unpack(state)
        return _dequant(u["q"], u["zero"], u["scale"], self.group_size, dtype)

    def state_names(self) -> tuple[str, ...]:
        return ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape")

    # --- runtime ----------------------------------------------------------------------------------
    def prepare(self, state: dict[str, torch.Tensor], device: torch.device | str) -> PreparedWeight:
        u = {k: v.to(device) for k, v in self.unpack(state).items()}
        n, k = u["q"].shape[-2:]
        if torch.device(device).type == "cpu" and n % 16 == 0 and self.group_size in _CPU_KERNEL_GROUPS:
            return PreparedWeight("cpu_int4pack", _cpu_layout(u), n, k)
        tensors = {"nibbles": pack_nibbles(u["q"]), "weight_scale": u["scale"], "zero": u["zero"]}
        return PreparedWeight("dequant", tensors, n, k)

    def kernel_for(self, weight: PreparedWeight, num_tokens: int) -> str:
        return weight.kernel

    def apply(self, weight: PreparedWeight, x: torch.Tensor) -> torch.Tensor:
        t = weight.tensors
        if weight.kernel == "cpu_int4pack":
            xin = x if x.dtype in (torch.bfloat16, torch.float32) else x.to(torch.bfloat16)
            sz = t["scales_zeros"].to(xin.dtype)
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(
                xin.contiguous(), t["packed"], self.group_size, sz
            )
            return out.to(x.dtype)
        w = _dequant(unpack_nibbles(t["nibbles"]), t["zero"], t["weight_scale"], self.group_size, x.dtype)
        return F.linear(x, w)

    def embedding_rows(
        self, state: dict[str, torch.Tensor], ids: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        q = unpack_nibbles(int32_to_nibbles(state["weight_packed"][ids]))
        words = state["weight_zero_point"][ids // 8]  # zero points are packed 8 rows to a word
        zero = (words >> (4 * (ids % 8)).unsqueeze(-1).to(torch.int32)) & 15
        return _dequant(q, zero, state["weight_scale"][ids], self.group_size, dtype)

    def scheme(self) -> dict[str, Any]:
        weights = ct_args(
            num_bits=4, type="int", symmetric=False, strategy="group", group_size=self.group_size
        )
        return {"format": self.checkpoint_format, "weights": weights, "input_activations": None}


def _dequant(
    q: torch.Tensor, zero: torch.Tensor, scale: torch.Tensor, group: int, dtype: torch.dtype
) -> torch.Tensor:
    """(q - zero) * scale per group: uint8 `[..., N, K]`, `[..., N, K/G]` x2 -> `[..., N, K]` in `dtype`."""
    groups = q.unflatten(-1, (q.shape[-1] // group, group)).to(torch.float32)
    w = (groups - zero.unsqueeze(-1).to(torch.float32)) * scale.unsqueeze(-1).to(torch.float32)
    return w.flatten(-2).to(dtype)


def _cpu_layout(u: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Repack unpacked `q/zero/scale` (any leading dims) for `_weight_int4pack_mm_for_cpu`."""
    q, zero, scale = u["q"], u["zero"], u["scale"]
    lead = q.shape[:-2]
    flat_q = q.reshape(-1, *q.shape[-2:])
    packed = torch.stack(
        [torch.ops.aten._convert_weight_to_int4pack_for_cpu(m.to(torch.int32), 1) for m in flat_q]
    )
    zero_term = ((8 - zero.to(torch.float32)) * scale.to(torch.float32)).to(torch.bfloat16)
    # kernel wants [K/G, N, 2] with (scale, zero) pairs
    sz = torch.stack([scale.to(torch.bfloat16), zero_term], dim=-1).transpose(-3, -2).contiguous()
    return {"packed": packed.reshape(*lead, *packed.shape[1:]), "scales_zeros": sz}

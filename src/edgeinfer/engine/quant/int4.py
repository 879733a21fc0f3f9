"""int4 weights, group-wise asymmetric (W4A16 / W4A8), compressed-tensors `pack-quantized`.

Each group of `group_size` consecutive inputs of a row has a bf16 scale and a bf16 zero point:
`w ~= (q - zp) * scale` with `q` in [0, 15] and `zp` a float in [0, 15] (compressed-tensors' `zp_dtype`
bfloat16; llama.cpp's Q4_1 likewise keeps a float offset). An integer zero point wastes up to half a step on
every group whose range does not fall on the grid; a float one lets a least-squares fit place the 16 levels
where the (importance-weighted) weights are, which cuts the perplexity rise markedly, with GPTQ and rounding
to nearest alike (docs/quantization.md), for 12 more bits per group. Checkpoints with integer zero points
(4-bit, packed 8 rows to an int32) still load.

`fit` searches each group's grid (llama.cpp's `make_qkx3_quants` idea): candidate step sizes around the
group's range, each followed by a weighted least-squares refit of scale and offset given its codes, the
lowest weighted squared error kept. The weights are the inputs' mean squares from calibration (their
energy, when given) times `sqrt(mean(w^2) + w^2)` of the row, so large weights and busy inputs are fitted
closest. (This replaced a search over clipped ranges: with the fit, clipping no longer gained anything.)

On CPU the runtime form is the layout of torch's fused `_weight_int4pack_mm_for_cpu` kernel, which
dequantizes in registers; that layout depends on the CPU's vector width, so it is rebuilt at load and never
saved. The kernel computes `(q - 8) * scale + zero`; `zero = (8 - zp) * scale` is rounded to bf16, which
adds at most `scale / 64` (|8 - zp| <= 8, bf16 rounds to within 2^-9 relative). Our W4A8 kernel reads the
same codes and zero terms, so both CPU paths multiply by the same weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from edgeinfer.engine import kernels
from edgeinfer.engine.kernels import ops
from edgeinfer.engine.quant.base import (
    PreparedWeight,
    QuantizationError,
    WeightMethod,
    ct_args,
    register_weight_method,
    row_chunks,
)
from edgeinfer.engine.quant.packing import (
    int32_to_nibbles,
    nibbles_to_int32,
    pack_nibbles,
    unpack_nibbles,
)
from edgeinfer.engine.runtime import runtime

GROUP_SIZES = (32, 64, 128)
# Groups of 32, as Q4_0 / Q4_K blocks: far more accurate than groups of 128 (docs/quantization.md), for more
# scales and a somewhat slower batched decode step (the fused kernel reads 4x the scales once per 4 rows).
DEFAULT_GROUP_SIZE = 32
_CPU_KERNEL_GROUPS = (32, 64, 128, 256)
# Levels per group range tried by the grid search: 15 + r for r in -0.9 .. 0.9 (as llama.cpp's Q4_1 search).
_LEVELS = tuple(15 + 0.1 * i for i in range(-9, 10))


@register_weight_method("int4")
class Int4Method(WeightMethod):
    """Group-wise asymmetric 4-bit weights, two per byte."""

    name = "int4"
    checkpoint_format = "pack-quantized"

    def __init__(self, group_size: int = DEFAULT_GROUP_SIZE) -> None:
        if group_size not in GROUP_SIZES:
            raise QuantizationError(f"int4 group_size must be one of {GROUP_SIZES}, got {group_size}")
        self.group_size = group_size

    def options(self) -> dict[str, Any]:
        return {"group_size": self.group_size}

    # --- float <-> unpacked <-> state ------------------------------------------------------------
    def quantize(self, weight: torch.Tensor, energy: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """The state of a float `[..., N, K]` weight; `energy` `[K]` (mean squared input per column, from
        calibration) weights the grid fit toward the inputs that carry the most."""
        if weight.dim() < 2:
            raise QuantizationError(f"int4 quantizes matrices, got shape {tuple(weight.shape)}")
        k = weight.shape[-1]
        if k % self.group_size:
            raise QuantizationError(
                f"int4: in_features {k} is not a multiple of group_size {self.group_size}"
            )
        rows = weight.detach().reshape(-1, k)
        nibbles = torch.empty(rows.shape[0], k // 2, dtype=torch.uint8, device=weight.device)
        scale = torch.empty(rows.shape[0], k // self.group_size, dtype=torch.bfloat16, device=weight.device)
        zero = torch.empty_like(scale)
        for part in row_chunks(rows.shape[0], k):
            groups = rows[part].float().unflatten(-1, (k // self.group_size, self.group_size))
            scale[part], zero[part] = self.fit(groups, energy)
            nibbles[part] = pack_nibbles(self.encode(groups, scale[part], zero[part]).flatten(-2))
        lead = weight.shape[:-1]
        return self._state(nibbles.view(*lead, -1), scale.view(*lead, -1), zero.view(*lead, -1))

    def fit(
        self, groups: torch.Tensor, energy: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per group of `[..., G]` fp32 weights (`[..., N, K/G, G]`): its bf16 scale and bf16 zero point,
        searched to minimise the weighted squared error (see the module doc)."""
        w = groups.float()
        sigma2 = w.square().mean((-1, -2), keepdim=True)
        e = torch.sqrt(sigma2 + w.square())
        if energy is not None:
            e = e * energy.float().reshape(w.shape[-2:]).clamp(min=0)
        return _search_grid(w, e)

    @staticmethod
    def encode(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
        """uint8 codes of fp32 weights `w [..., G]` on the grid of `scale, zero [...]` (clamped to it)."""
        s, z = scale.float().unsqueeze(-1), zero.float().unsqueeze(-1)
        return torch.round(w / s + z).clamp_(0, 15).to(torch.uint8)

    def pack(self, unpacked: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return self._state(pack_nibbles(unpacked["q"]), unpacked["scale"], unpacked["zero"])

    @staticmethod
    def _state(nibbles: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> dict[str, torch.Tensor]:
        """The state of packed codes `[..., N, K/2]` and their groups' scales and zero points."""
        rows, k = nibbles.shape[-2], 2 * nibbles.shape[-1]
        shape = torch.tensor([rows, k], dtype=torch.int32).expand(*nibbles.shape[:-2], 2).contiguous()
        return {
            "weight_packed": nibbles_to_int32(nibbles),
            "weight_scale": scale.to(torch.bfloat16),
            "weight_zero_point": zero.to(torch.bfloat16),
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
        zero = state["weight_zero_point"]
        if zero.dtype != torch.bfloat16 or zero.shape != scale.shape:
            raise QuantizationError(
                f"int4 state: weight_zero_point must be bf16 {tuple(scale.shape)}, got {zero.dtype} "
                f"{tuple(zero.shape)} (integer zero points are converted when a checkpoint loads)"
            )
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

    def gemv_form(self, weight: PreparedWeight) -> PreparedWeight | None:
        """A 2-D weight in the CPU layout, re-laid for `int4_gemv` (W4A8): that kernel is faster than torch's
        int4 kernel and, from 64 rows, than a bf16 GEMM on the dequantized weight, at every row count
        measured (docs/quantization.md, our CPU kernels). Stacked experts are re-laid one by one. Not for
        an unknown packing."""
        dims = weight.tensors["scale_kn"].dim() if weight.kernel == "cpu_int4pack" else 0
        if dims not in (3, 4) or not _unpackable(weight.out_features):
            return None
        experts = [weight] if dims == 3 else [weight.select(e) for e in range(len(weight.tensors["packed"]))]
        forms = [kernels.int4_pack(*_int4pack_codes(e.tensors, weight.in_features)) for e in experts]
        parts = forms[0] if dims == 3 else [torch.stack(stack) for stack in zip(*forms, strict=True)]
        tensors = dict(zip(("codes", "scales", "zero_terms"), parts, strict=True))
        return PreparedWeight("cpu_w4a8", tensors, weight.out_features, weight.in_features)

    def kernel_for(self, weight: PreparedWeight, num_tokens: int) -> str:
        if weight.kernel == "cpu_w4a8":
            return "cpu_w4a8"
        large = num_tokens >= _DEQUANT_MIN_TOKENS
        if weight.kernel == "cpu_int4pack" and large and _unpackable(weight.out_features):
            return "dequant"
        return weight.kernel

    def apply(self, weight: PreparedWeight, x: torch.Tensor) -> torch.Tensor:
        t = weight.tensors
        if weight.kernel == "cpu_w4a8":
            return self._apply_w4a8(t, x)
        if weight.kernel == "cpu_int4pack":
            xin = x if x.dtype in (torch.bfloat16, torch.float32) else x.to(torch.bfloat16)
            if self.kernel_for(weight, x.shape[0]) == "dequant":
                w = _int4pack_to_kn(t["packed"], t["scale_kn"], t["zero_kn"], weight.in_features, xin.dtype)
                return torch.mm(xin, w).to(x.dtype)
            sz = t["scales_zeros"].to(xin.dtype)
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(
                xin.contiguous(), t["packed"], self.group_size, sz
            )
            return out.to(x.dtype)
        w = _dequant(unpack_nibbles(t["nibbles"]), t["zero"], t["weight_scale"], self.group_size, x.dtype)
        return F.linear(x, w)

    def _apply_w4a8(self, t: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        xin = x if x.dtype in (torch.bfloat16, torch.float32) else x.to(torch.bfloat16)
        y = ops.int4_gemv(xin.contiguous(), t["codes"], t["scales"], t["zero_terms"], self.group_size)
        return y.to(x.dtype)

    def embedding_rows(
        self, state: dict[str, torch.Tensor], ids: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        q = unpack_nibbles(int32_to_nibbles(state["weight_packed"][ids]))
        zero = state["weight_zero_point"][ids]
        return _dequant(q, zero, state["weight_scale"][ids], self.group_size, dtype)

    def scheme(self) -> dict[str, Any]:
        weights = ct_args(
            num_bits=4,
            type="int",
            symmetric=False,
            strategy="group",
            group_size=self.group_size,
            zp_dtype="bfloat16",
        )
        return {"format": self.checkpoint_format, "weights": weights, "input_activations": None}


def _dequant(
    q: torch.Tensor, zero: torch.Tensor, scale: torch.Tensor, group: int, dtype: torch.dtype
) -> torch.Tensor:
    """(q - zero) * scale per group: uint8 `[..., N, K]`, `[..., N, K/G]` x2 -> `[..., N, K]` in `dtype`."""
    groups = q.unflatten(-1, (q.shape[-1] // group, group)).to(torch.float32)
    w = (groups - zero.unsqueeze(-1).to(torch.float32)) * scale.unsqueeze(-1).to(torch.float32)
    return w.flatten(-2).to(dtype)


def _search_grid(w: torch.Tensor, e: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 scale and zero point `[...]` per group of `w [..., G]` minimising `sum(e * (w - (q - zp) * s)^2)`
    over the min/max grid and, for each of `_LEVELS`, the least-squares refit of its codes. A refit that
    would move some weight by more than one step of the min/max grid is not taken, so no weight errs by more
    than that step (twice min/max rounding's worst case) plus the bf16 rounding of scale and zero point."""
    lo = w.amin(-1, keepdim=True).clamp(max=0)
    hi = w.amax(-1, keepdim=True).clamp(min=0)
    span = torch.where(hi > lo, hi - lo, torch.ones_like(hi))
    sums = (e.sum(-1, keepdim=True), (e * w).sum(-1, keepdim=True))
    best_s, best_m = span / 15, lo
    best_err, _ = _grid_error(w, e, best_s, best_m)
    above = w - lo
    for levels in _LEVELS:
        q = torch.mul(above, levels / span).round_().clamp_(0, 15)
        s, m = _refit(w, e, q, sums)
        s, m = torch.where(s > 0, s, span / 15), torch.where(s > 0, m, lo)
        err, worst = _grid_error(w, e, s, m)
        better = (err < best_err) & (worst <= span / 15)
        best_err = torch.where(better, err, best_err)
        best_s, best_m = torch.where(better, s, best_s), torch.where(better, m, best_m)
    scale = best_s.squeeze(-1).to(torch.bfloat16)
    zero = (-best_m.squeeze(-1) / scale.float()).clamp_(0, 15).to(torch.bfloat16)
    return scale, zero


def _refit(
    w: torch.Tensor, e: torch.Tensor, q: torch.Tensor, sums: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted least squares `w ~= s * q + m` per group for fixed codes, with the offset kept in
    `[-15 s, 0]` (zero point in [0, 15]); s <= 0 where the codes cannot determine a scale."""
    sw, sx = sums
    eq = e * q
    sq, sqq, sxq = eq.sum(-1, keepdim=True), (eq * q).sum(-1, keepdim=True), (eq * w).sum(-1, keepdim=True)
    det = sw * sqq - sq * sq
    ok = det > 0
    det = torch.where(ok, det, torch.ones_like(det))
    s = torch.where(ok, (sw * sxq - sq * sx) / det, torch.zeros_like(det))
    m = (sqq * sx - sq * sxq) / det
    # the constrained optimum on the boundary the free one crossed: offset 0, or offset -15 s
    s_top = sxq / sqq.clamp(min=1e-30)
    s_bottom = (sxq - 15 * sx) / (sqq - 30 * sq + 225 * sw).clamp(min=1e-30)
    high, low = m > 0, m < -15 * s
    s = torch.where(high, s_top, torch.where(low, s_bottom, s))
    m = torch.where(high, torch.zeros_like(m), torch.where(low, -15 * s, m))
    return s, m


def _grid_error(
    w: torch.Tensor, e: torch.Tensor, s: torch.Tensor, m: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted squared error and largest error of `w` rounded to the grid `s * q + m`, `q` in [0, 15]."""
    # in place where a temporary can be reused: this runs 20 times over every weight
    diff = torch.sub(w, m).div_(s).round_().clamp_(0, 15).mul_(s)
    diff = torch.sub(w, diff, out=diff).sub_(m)
    worst = diff.abs().amax(-1, keepdim=True)
    return diff.square_().mul_(e).sum(-1, keepdim=True), worst


def _cpu_layout(u: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Repack unpacked `q/zero/scale` (any leading dims) for `_weight_int4pack_mm_for_cpu`.

    `scale_kn`/`zero_kn` (`[..., K/G, 1, N]`, 1/16 of the packed bytes) are the same values laid out for
    the large-M path, which broadcasts them over each group's rows of a dequantized `[K, N]` weight.
    """
    q, zero, scale = u["q"], u["zero"], u["scale"]
    lead = q.shape[:-2]
    flat_q = q.reshape(-1, *q.shape[-2:])
    packed = torch.stack(
        [torch.ops.aten._convert_weight_to_int4pack_for_cpu(m.to(torch.int32), 1) for m in flat_q]
    )
    scale_kn = scale.to(torch.bfloat16).transpose(-1, -2).unsqueeze(-2).contiguous()
    zero_term = ((8 - zero.to(torch.float32)) * scale.to(torch.float32)).to(torch.bfloat16)
    zero_kn = zero_term.transpose(-1, -2).unsqueeze(-2).contiguous()
    # kernel wants [K/G, N, 2] with (scale, zero) pairs
    sz = torch.stack([scale.to(torch.bfloat16), zero_term], dim=-1).transpose(-3, -2).contiguous()
    return {
        "packed": packed.reshape(*lead, *packed.shape[1:]),
        "scales_zeros": sz,
        "scale_kn": scale_kn,
        "zero_kn": zero_kn,
    }


# --- large-M path ---------------------------------------------------------------------------------
# The fused CPU kernel loops over the rows of x (cost linear in M), so for a prefill it is slower than one
# bf16 GEMM. From this many rows on, dequantizing the packed weight (cheap, once per call) and running a
# bf16 GEMM wins on small models' layer shapes.
_DEQUANT_MIN_TOKENS = 64


@dataclass(frozen=True)
class PackLayout:
    """Where the fused kernel's packing puts each weight, as observed on this machine.

    Rows are packed in blocks of `block_n`: block `b` is `[K, block_n / 2]` bytes, and byte `j` of row `k`
    holds `q[b * block_n + c, k]` for `c = lo_cols[j]` in its low nibble and `c = hi_cols[j]` in its high one.
    """

    block_n: int
    lo_cols: slice
    hi_cols: slice


def probe_pack_layout() -> PackLayout | None:
    """Probe the packing (it depends on the CPU's vector width): None when it is none of the known forms."""
    n, k = 256, 32
    rows = torch.arange(n, dtype=torch.int32).unsqueeze(1).expand(n, k)
    cols = torch.arange(k, dtype=torch.int32).expand(n, k)
    probes = [rows & 15, rows >> 4, cols & 15]
    packed = [torch.ops.aten._convert_weight_to_int4pack_for_cpu(p.contiguous(), 1) for p in probes]
    for block_n in (64, 32):
        half = block_n // 2
        for layout in (
            PackLayout(block_n, slice(0, half), slice(half, block_n)),
            PackLayout(block_n, slice(0, block_n, 2), slice(1, block_n, 2)),
        ):
            lo_rows, hi_rows, k_of = (_unpack_blocks(p, layout, n, k) for p in packed)
            want = torch.arange(n, dtype=torch.int32).view(n // block_n, 1, block_n)
            if torch.equal(lo_rows + 16 * hi_rows, want.expand(-1, k, -1)) and torch.equal(
                k_of, (torch.arange(k, dtype=torch.int32) & 15).view(1, k, 1).expand_as(k_of)
            ):
                return layout
    return None


def _unpack_blocks(packed: torch.Tensor, layout: PackLayout, n: int, k: int) -> torch.Tensor:
    """Nibbles of a probe's packing as `[n / block_n, k, block_n]` int32 (column c = row b * block_n + c)."""
    bytes_ = packed.reshape(n // layout.block_n, k, layout.block_n // 2).to(torch.int32)
    out = torch.empty(n // layout.block_n, k, layout.block_n, dtype=torch.int32)
    out[..., layout.lo_cols] = bytes_ & 15
    out[..., layout.hi_cols] = bytes_ >> 4
    return out


def _unpackable(n: int) -> bool:
    """Whether a packed `n`-row weight can be dequantized here (the packing's last, partial block differs)."""
    layout = runtime().int4_pack
    return layout is not None and n % layout.block_n == 0


def _int4pack_codes(t: dict[str, torch.Tensor], k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes `[N, K]` (uint8, `q` in [0, 15]), zero terms and scales (bf16 `[N, K/G]`) of a 2-D weight's CPU
    layout: the fused kernel's weight is `(q - 8) * scale + zero_term`, read here exactly as stored."""
    n = t["scale_kn"].shape[-1]
    codes = _int4pack_centered(t["packed"], k, n, torch.int16).add_(8).t().contiguous().to(torch.uint8)
    return codes, t["zero_kn"].squeeze(1).t(), t["scale_kn"].squeeze(1).t()


def _int4pack_centered(packed: torch.Tensor, k: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """The packing's codes minus 8 as a contiguous `[K, N]` in `dtype`. The packing's blocks are already
    K-major, so each block unpacks into a column range and no transpose is needed."""
    layout = runtime().int4_pack
    assert layout is not None  # kernel_for / gemv_form checked
    blocks = packed.view(n // layout.block_n, k, layout.block_n // 2).view(torch.int8)
    w = torch.empty(k, n // layout.block_n, layout.block_n, dtype=dtype)
    by_block = w.permute(1, 0, 2)
    # the bytes as int8: `& 15` and `>> 4` of the unsigned byte, shifted to [-8, 7], then converted on copy
    by_block[..., layout.lo_cols] = (blocks & 15) - 8
    by_block[..., layout.hi_cols] = (blocks.view(torch.uint8) >> 4).view(torch.int8) - 8
    return w.view(k, n)


def _int4pack_to_kn(
    packed: torch.Tensor, scale_kn: torch.Tensor, zero_kn: torch.Tensor, k: int, dtype: torch.dtype
) -> torch.Tensor:
    """The weight the fused kernel multiplies by, `W.T` as a contiguous `[K, N]` in `dtype`.

    `(q - 8) * scale + zero` as the kernel computes it (in fp32, one rounding), so the two paths differ only
    by the rounding of the weight to `dtype`.
    """
    groups, _, n = scale_kn.shape
    w = _int4pack_centered(packed, k, n, dtype)
    by_group = w.view(groups, k // groups, n)
    torch.addcmul(zero_kn, by_group, scale_kn, out=by_group)
    return w

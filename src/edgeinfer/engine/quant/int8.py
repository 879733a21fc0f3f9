"""int8 weights (per-output-channel symmetric) x int8 activations (per token, dynamic) -> `torch._int_mm`.

Error per weight is at most half a step, `amax_row / 254`; activations likewise per token. On CPU the int8
GEMM is faster than a bf16 one of the same shape (docs/quantization.md has the numbers).

`hadamard=B` (the engine's default at load, B = 128) rotates the input dimension by a block-diagonal
Walsh-Hadamard matrix H (blocks of B; orthogonal and symmetric, so H @ H = I): the layer stores
`Q(W @ H)` and computes `Q(x @ H) @ Q(W @ H).T`, equal to `x @ W.T` before rounding. The rotation spreads
an outlier channel over its block, so one large activation no longer sets the whole token's int8 step (the
QuaRot / QuIP "incoherence" idea); it removes most of int8's remaining error even after activation-aware
scaling (docs/quantization.md), for one [M, K/B, B] x [B, B] matmul per layer. Off by default in the method
itself, because a compressed-tensors int8 checkpoint is unrotated.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import torch

from edgeinfer.engine.kernels import GEMV_KN_ROWS, GEMV_ROWS, ops
from edgeinfer.engine.quant.base import PreparedWeight, QuantizationError, ct_args, register_weight_method
from edgeinfer.engine.quant.channelwise import ChannelwiseMethod

QMAX = 127  # symmetric range [-127, 127]: -128 would make the grid lopsided
_EPILOGUE_ELEMS = 1 << 20  # outputs per column block (4 MB of fp32) ...
_MIN_BLOCK = 8192  # ... but never blocks narrower than this


def quantize_rows_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: `[..., K]` -> (int8 `[..., K]`, fp32 scale `[..., 1]`); zero rows: scale 1."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True) / QMAX
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = torch.round(xf / scale).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale


def int_mm_supported(num_tokens: int, in_features: int, out_features: int, device: torch.device) -> bool:
    """Whether `torch._int_mm` accepts this shape on `device`.

    CPU (torch 2.13) takes any 2-D shape; the CUDA kernel needs M > 16 and K, N multiples of 8.
    """
    if device.type == "cpu":
        return True
    if device.type == "cuda":
        return num_tokens > 16 and in_features % 8 == 0 and out_features % 8 == 0
    return False


@register_weight_method("int8")
class Int8Method(ChannelwiseMethod):
    """W8A8 dynamic: compressed-tensors `int-quantized`, channel-wise weights, token-wise activations."""

    name = "int8"
    checkpoint_format = "int-quantized"
    storage_dtype = torch.int8
    quantizes_activations = True

    def __init__(self, hadamard: int = 0) -> None:
        if hadamard and (hadamard < 16 or hadamard & (hadamard - 1)):
            raise QuantizationError(f"int8 hadamard block must be 0 or a power of two >= 16, got {hadamard}")
        self.hadamard = hadamard

    def options(self) -> dict[str, Any]:
        return {"hadamard": self.hadamard} if self.hadamard else {}

    def rotation_block(self, in_features: int) -> int:
        """The Hadamard block for `in_features` inputs: at most `hadamard`, a power of two dividing
        `in_features`; 0 (no rotation) when that would be below 16."""
        block = min(self.hadamard, in_features & -in_features)
        return block if block >= 16 else 0

    def rotate(self, t: torch.Tensor) -> torch.Tensor:
        """`t @ H` over the last dim, in fp32 (its own inverse); `t` unchanged without rotation."""
        k = t.shape[-1]
        block = self.rotation_block(k)
        if not block:
            return t
        h = _hadamard(block, t.device)
        return (t.float().reshape(*t.shape[:-1], k // block, block) @ h).reshape(t.shape)

    def transform(self, rows: torch.Tensor) -> torch.Tensor:
        return self.rotate(rows)

    def dequantize(self, state: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        return self.rotate(super().dequantize(state, torch.float32)).to(dtype)

    def embedding_rows(
        self, state: dict[str, torch.Tensor], ids: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        return self.rotate(super().embedding_rows(state, ids, torch.float32)).to(dtype)

    def quantize_rows(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_rows_int8(x)

    def widen(self, q: torch.Tensor) -> torch.Tensor:
        return q.float()

    def kernel_for_device(self, device: torch.device) -> str:
        return "int_mm"

    def prepare(self, state: dict[str, torch.Tensor], device: torch.device | str) -> PreparedWeight:
        prepared = super().prepare(state, device)
        if prepared.in_features > prepared.out_features:
            # on CPU, for K > N the kernel is much faster on a row-major [K, N] operand; for
            # K <= N (and the lm_head) on the column-major view of [N, K], which also keeps the embedding
            # table shareable
            q = prepared.tensors.pop("weight")
            prepared.tensors = {"weight_t": q.transpose(-1, -2).contiguous(), **prepared.tensors}
        return prepared

    def kernel_for(self, weight: PreparedWeight, num_tokens: int) -> str:
        rows = GEMV_KN_ROWS if "weight_t" in weight.tensors else GEMV_ROWS
        if weight.kernel == "cpu_gemv" and num_tokens <= rows:
            return "cpu_gemv"
        device = weight.tensors["weight_scale"].device
        ok = int_mm_supported(num_tokens, weight.in_features, weight.out_features, device)
        return "int_mm" if ok else "dequant"

    def apply(self, weight: PreparedWeight, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(weight, x, None)

    def apply_into(self, weight: PreparedWeight, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return self._matmul(weight, x, out)

    def _matmul(self, weight: PreparedWeight, x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        t = weight.tensors
        w_kn = t["weight_t"] if "weight_t" in t else t["weight"].t()  # [K, N], either layout
        w_scale = t["weight_scale"]
        xr = self.rotate(x)
        if self.kernel_for(weight, x.shape[0]) == "dequant":
            # weight-only fallback: the per-channel scale commutes with the matmul, apply it to the output
            y = ((xr.to(x.dtype) @ w_kn.to(x.dtype)).float() * w_scale).to(x.dtype)
            return y if out is None else out.copy_(y)
        xq, x_scale = quantize_rows_int8(xr)
        n = weight.out_features
        if self.kernel_for(weight, x.shape[0]) == "cpu_gemv":
            xs = x_scale.reshape(-1)
            if "weight_t" in t:
                y = ops.int8_gemv_kn(xq, xs, t["weight_t"], w_scale)
                return (y if y.dtype == x.dtype else y.to(x.dtype)) if out is None else out.copy_(y)
            if out is not None and out.dtype == torch.float32 and out.is_contiguous():
                ops.int8_gemv_out(xq, xs, t["weight"], w_scale, out)  # the logits buffer, filled in place
                return out
            y = ops.int8_gemv(xq, xs, t["weight"], w_scale)
            return (y if y.dtype == x.dtype else y.to(x.dtype)) if out is None else out.copy_(y)
        # every epilogue scales by the weight, then the token: `int8_gemv`'s order, so the two agree exactly
        block = max(_MIN_BLOCK, _EPILOGUE_ELEMS // max(1, x.shape[0]))
        if n <= block:
            y = torch._int_mm(xq, w_kn).float().mul_(w_scale).mul_(x_scale)
            return y.to(x.dtype) if out is None else out.copy_(y)
        # wide outputs (lm_head): column blocks keep the int32 -> scaled float epilogue in cache
        if out is None:
            out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
        for s in range(0, n, block):
            acc, part = torch._int_mm(xq, w_kn[:, s : s + block]), out[:, s : s + block]
            if out.dtype == torch.float32:  # convert by copy_ and scale in place: no temporaries to fill
                part.copy_(acc).mul_(w_scale[s : s + block]).mul_(x_scale)
            else:  # scale in fp32, round once
                part.copy_(acc.float().mul_(w_scale[s : s + block]).mul_(x_scale))
        return out

    def gemv_form(self, weight: PreparedWeight) -> PreparedWeight | None:
        """A 2-D CPU weight as it is, so switching costs no memory: `int8_gemv` reads the row-major `[N, K]`
        codes (the shared embedding table included), `int8_gemv_kn` the `[K, N]` ones of layers with more
        inputs than outputs; for stacked experts, each expert's slice."""
        q = weight.tensors.get("weight", weight.tensors.get("weight_t"))
        if q is None or q.dim() not in (2, 3) or q.device.type != "cpu":
            return None
        return PreparedWeight("cpu_gemv", dict(weight.tensors), weight.out_features, weight.in_features)

    def scheme(self) -> dict[str, Any]:
        return {
            "format": self.checkpoint_format,
            "weights": ct_args(num_bits=8, type="int", symmetric=True, strategy="channel"),
            "input_activations": ct_args(
                num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True
            ),
        }


@cache
def _hadamard(n: int, device: torch.device) -> torch.Tensor:
    """The normalised n x n Walsh-Hadamard matrix (Sylvester's construction), fp32."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / n**0.5).to(device)

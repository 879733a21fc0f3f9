"""Rotary position embeddings: default, linear, llama3 and yarn frequency schedules."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from edgeinfer.engine.kernels import ops
from edgeinfer.engine.model.layers.kernel_ops import takes_kernel


def _default_inv_freq(dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    factor = params["factor"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    old_ctx = params["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(
    dim: int, theta: float, params: dict[str, Any], max_pos: int
) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies, keep high ones, blend with a linear ramp (DeepSeek/Kimi configs)."""
    factor = params["factor"]
    old_ctx = params.get("original_max_position_embeddings") or max_pos
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old_ctx / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low = math.floor(correction_dim(beta_fast))
    high = math.ceil(correction_dim(beta_slow))
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolation = _default_inv_freq(dim, theta)
    interpolation = extrapolation / factor
    extrapolation_weight = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight
    mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
    if params.get("attention_factor") is not None:
        attention = float(params["attention_factor"])
    elif mscale and mscale_all:
        attention = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
    else:
        attention = _yarn_mscale(factor)
    return inv_freq, attention


def rope_inv_freq(dim: int, params: dict[str, Any], max_pos: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the cos/sin scale (`attention_factor`) for one rope config."""
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", 10000.0))
    if rope_type == "default":
        return _default_inv_freq(dim, theta), 1.0
    if rope_type == "linear":
        return _default_inv_freq(dim, theta) / params["factor"], 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(_default_inv_freq(dim, theta), params), 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(dim, theta, params, max_pos)
    raise ValueError(f"unsupported rope_type {rope_type!r} (default, linear, llama3, yarn)")


class RotaryEmbedding(nn.Module):
    """Applies rope to the first `rotary_dim` channels of q and k.

    `interleaved=False` rotates halves (HF's rotate_half); `True` rotates adjacent pairs (GPT-J / DeepSeek
    `rope_interleave`). Cos/sin are cached for all positions up to `max_pos` in fp32.
    """

    def __init__(
        self, rotary_dim: int, params: dict[str, Any], max_pos: int, interleaved: bool = False
    ) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim
        self.interleaved = interleaved
        if torch.get_default_device().type == "meta":
            # a shell that the prepared-form cache fills: no values are needed, and computing them on the
            # meta device would import torch's compiler stack (a large share of a cached load)
            cos = sin = torch.empty(max_pos, rotary_dim // 2)
        else:
            inv_freq, scale = rope_inv_freq(rotary_dim, params, max_pos)
            freqs = torch.outer(torch.arange(max_pos, dtype=torch.float64), inv_freq)
            cos, sin = (freqs.cos() * scale).float(), (freqs.sin() * scale).float()
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self._step_cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.kernel_elements = 0  # small bf16 rotations through our one-call `rope` (layers/kernel_ops.py)

    def forward(self, positions: torch.Tensor, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Rotate each x of shape [T, heads, head_dim] at `positions` [T]."""
        cos, sin = self.tables(positions, xs[0].dtype)
        return tuple(self._rotate(x, cos, sin) for x in xs)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # Every layer of a step passes the same positions tensor: gather cos/sin once per step, in the
        # activations' dtype (as HF rotates, so bf16 results match it too).
        # A compiled graph fuses the gather into the rotation instead.
        if torch.compiler.is_compiling():
            return self._gather(positions, dtype)
        cached = self._step_cache
        if cached is not None and cached[0] is positions and cached[1].dtype == dtype:
            return cached[1], cached[2]
        cos, sin = self._gather(positions, dtype)
        self._step_cache = (positions, cos, sin)
        return cos, sin

    def _gather(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        if not self.interleaved:
            cos, sin = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
        return cos.to(dtype), sin.to(dtype)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if takes_kernel(self, x):
            return ops.rope(x, cos, sin, self.rotary_dim, self.interleaved)
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        if self.interleaved:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
            out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        else:
            x1, x2 = rot.chunk(2, dim=-1)
            out = rot * cos + torch.cat((-x2, x1), dim=-1) * sin
        return out if rest.shape[-1] == 0 else torch.cat((out, rest), dim=-1)

"""Multi-head / grouped-query self-attention with fused QKV, optional QK-norm, rope and paged KV."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from edgeinfer.engine.attention.backend import AttentionBackend
from edgeinfer.engine.model.layers.norm import RMSNorm
from edgeinfer.engine.model.layers.rotary import RotaryEmbedding


@dataclass(frozen=True)
class AttentionShape:
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    bias: bool = False
    out_bias: bool = False
    qk_norm: bool = False
    qk_norm_eps: float = 1e-6
    qk_norm_unit_offset: bool = False
    scale: float | None = None  # default head_dim ** -0.5
    window: int | None = None
    softcap: float | None = None


class SelfAttention(nn.Module):
    def __init__(self, layer_idx: int, shape: AttentionShape, rope: RotaryEmbedding) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.shape = shape
        self.q_size = shape.num_heads * shape.head_dim
        self.kv_size = shape.num_kv_heads * shape.head_dim
        self.qkv_proj = nn.Linear(shape.hidden, self.q_size + 2 * self.kv_size, bias=shape.bias)
        self.o_proj = nn.Linear(self.q_size, shape.hidden, bias=shape.out_bias)
        self.rope = rope
        self.scale = shape.scale if shape.scale is not None else shape.head_dim**-0.5
        if shape.qk_norm:
            self.q_norm = RMSNorm(shape.head_dim, shape.qk_norm_eps, shape.qk_norm_unit_offset)
            self.k_norm = RMSNorm(shape.head_dim, shape.qk_norm_eps, shape.qk_norm_unit_offset)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend) -> torch.Tensor:
        q, k, v = self.project(x, positions)
        return self.output(self.attend(q, k, v, backend))

    # The three stages are separate so that the tensor-only ones can be compiled (model/compile.py) while
    # the paged attention, with its per-step Python metadata, stays eager.
    def project(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Normed input `[T, hidden]` -> rotated q `[T, Hq, D]`, k and v `[T, Hkv, D]`."""
        s = self.shape
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, s.num_heads, s.head_dim)
        k = k.view(-1, s.num_kv_heads, s.head_dim)
        v = v.view(-1, s.num_kv_heads, s.head_dim)
        if s.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rope(positions, q, k)
        return q, k, v

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: AttentionBackend
    ) -> torch.Tensor:
        s = self.shape
        return backend.attend(self.layer_idx, q, k, v, self.scale, s.window, s.softcap)

    def output(self, out: torch.Tensor) -> torch.Tensor:
        return self.o_proj(out.reshape(-1, self.q_size))

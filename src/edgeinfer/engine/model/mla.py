"""Multi-head latent attention layer (DeepSeek-V3 / Kimi K2): projections and rope here; the paged
attention over the latent cache is `attention.mla.LatentAttention`."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from edgeinfer.engine.attention.backend import AttentionBackend
from edgeinfer.engine.attention.mla import LatentAttention, LatentShape
from edgeinfer.engine.model.layers.norm import RMSNorm
from edgeinfer.engine.model.layers.rotary import RotaryEmbedding

# HF builds `q_a_layernorm` and `kv_a_layernorm` without passing `rms_norm_eps`, so they use this default.
_LORA_NORM_EPS = 1e-6


@dataclass(frozen=True)
class MLAShape:
    hidden: int
    num_heads: int
    q_lora_rank: int | None  # None: a full-rank `q_proj`
    kv_lora_rank: int
    nope_dim: int
    rope_dim: int
    v_dim: int
    bias: bool  # `attention_bias`: on q_a_proj, kv_a_proj_with_mqa and o_proj
    scale: float

    @property
    def qk_dim(self) -> int:
        return self.nope_dim + self.rope_dim

    @property
    def latent(self) -> LatentShape:
        return LatentShape(self.num_heads, self.kv_lora_rank, self.nope_dim, self.rope_dim, self.v_dim)


class KVUpProjection(nn.Module):
    """`kv_b_proj.weight` [H·(nope + v), kv_lora_rank]: the latent's up-projection to per-head k_nope and v.

    Not an `nn.Linear` on purpose: attention never applies it as one layer (absorbed decode splits it into
    per-head factors of the query and output; prefill expands latents with it), so weight quantizers, which
    swap `nn.Linear`s, leave it in float.
    """

    def __init__(self, kv_lora_rank: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, kv_lora_rank))


class MultiLatentAttention(nn.Module):
    """Parameter names follow HF's `DeepseekV3Attention`, so checkpoints load without renaming."""

    def __init__(self, layer_idx: int, shape: MLAShape, rope: RotaryEmbedding, impl: LatentAttention) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.shape = shape
        self.rope = rope
        self.impl = impl
        h, q_out = shape.hidden, shape.num_heads * shape.qk_dim
        if shape.q_lora_rank is None:
            self.q_proj = nn.Linear(h, q_out, bias=False)
        else:
            self.q_a_proj = nn.Linear(h, shape.q_lora_rank, bias=shape.bias)
            self.q_a_layernorm = RMSNorm(shape.q_lora_rank, _LORA_NORM_EPS)
            self.q_b_proj = nn.Linear(shape.q_lora_rank, q_out, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, shape.kv_lora_rank + shape.rope_dim, bias=shape.bias)
        self.kv_a_layernorm = RMSNorm(shape.kv_lora_rank, _LORA_NORM_EPS)
        self.kv_b_proj = KVUpProjection(shape.kv_lora_rank, shape.num_heads * (shape.nope_dim + shape.v_dim))
        self.o_proj = nn.Linear(shape.num_heads * shape.v_dim, h, bias=shape.bias)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend) -> torch.Tensor:
        s = self.shape
        q = self._query(x).view(-1, s.num_heads, s.qk_dim)
        q_nope, q_pe = q.split([s.nope_dim, s.rope_dim], dim=-1)
        c, k_pe = self.kv_a_proj_with_mqa(x).split([s.kv_lora_rank, s.rope_dim], dim=-1)
        q_pe, k_pe = self.rope(positions, q_pe, k_pe.unsqueeze(1))
        latent = torch.cat((self.kv_a_layernorm(c), k_pe.squeeze(1)), dim=-1)
        out = self.impl(
            backend, self.layer_idx, s.latent, q_nope, q_pe, latent, self.kv_b_proj.weight, s.scale
        )
        return self.o_proj(out.reshape(-1, s.num_heads * s.v_dim))

    def _query(self, x: torch.Tensor) -> torch.Tensor:
        if self.shape.q_lora_rank is None:
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

"""Mixture-of-experts decoder LMs: Qwen3-MoE, GLM-4.5 (GQA attention) and DeepSeek-V3 / Kimi K2 (MLA).

They share one skeleton: pre-norm decoder layers whose attention is GQA (`SelfAttention`) or latent
(`MultiLatentAttention`) and whose feed-forward is a dense gated MLP or a `SparseMoeBlock`, chosen per layer.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from edgeinfer.engine.attention.backend import AttentionBackend
from edgeinfer.engine.attention.mla import LatentAttention, get_latent_attention
from edgeinfer.engine.attention.registry import DEFAULT_MLA_MODE
from edgeinfer.engine.attention.storage import KVSpec
from edgeinfer.engine.model.layers.attention import AttentionShape, SelfAttention
from edgeinfer.engine.model.layers.mlp import GatedMLP
from edgeinfer.engine.model.layers.norm import RMSNorm
from edgeinfer.engine.model.layers.rotary import RotaryEmbedding
from edgeinfer.engine.model.mla import MLAShape, MultiLatentAttention
from edgeinfer.engine.model.moe import EXPERT_STACKS, FusedExperts, MoeSpec, SparseMoeBlock
from edgeinfer.engine.model.moe_weights import load_moe_weights
from edgeinfer.engine.model.weights import Shard
from edgeinfer.engine.quant.base import WeightMethod
from edgeinfer.engine.quant.layers import logits_fp32


@dataclass(frozen=True)
class MoeArgs:
    vocab_size: int
    hidden: int
    intermediate: int  # the dense layers' MLP width
    num_layers: int
    rms_eps: float
    act: str
    max_pos: int
    tie_embeddings: bool
    attention: AttentionShape | MLAShape
    rope: dict[str, Any]
    rope_dim: int  # channels rotated per head (partial rotary: fewer than head_dim)
    rope_interleaved: bool
    moe: MoeSpec
    sparse_layers: tuple[bool, ...]  # per layer: MoE feed-forward (True) or dense MLP (False)

    @property
    def is_mla(self) -> bool:
        return isinstance(self.attention, MLAShape)


class MoeDecoderLayer(nn.Module):
    def __init__(self, idx: int, args: MoeArgs, rope: RotaryEmbedding, latent: LatentAttention) -> None:
        super().__init__()
        a = args.attention
        if isinstance(a, MLAShape):
            self.self_attn: nn.Module = MultiLatentAttention(idx, a, rope, latent)
        else:
            self.self_attn = SelfAttention(idx, a, rope)
        if args.sparse_layers[idx]:
            self.mlp: nn.Module = SparseMoeBlock(args.moe)
        else:
            self.mlp = GatedMLP(args.hidden, args.intermediate, args.act)
        self.input_layernorm = RMSNorm(args.hidden, args.rms_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden, args.rms_eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


class MoeCausalLM(nn.Module):
    """Flat-batch forward like `DenseCausalLM`: `input_ids` [T] of all scheduled sequences concatenated."""

    def __init__(self, args: MoeArgs, mla_mode: str = DEFAULT_MLA_MODE) -> None:
        super().__init__()
        self.args = args
        rope = RotaryEmbedding(args.rope_dim, args.rope, args.max_pos, args.rope_interleaved)
        latent = get_latent_attention(mla_mode)
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(args.vocab_size, args.hidden)
        self.model.layers = nn.ModuleList(
            MoeDecoderLayer(i, args, rope, latent) for i in range(args.num_layers)
        )
        self.model.norm = RMSNorm(args.hidden, args.rms_eps)
        if not args.tie_embeddings:
            self.lm_head = nn.Linear(args.hidden, args.vocab_size, bias=False)

    @property
    def kv_spec(self) -> KVSpec:
        """GQA: K and V per KV head. MLA: one latent of `kv_lora_rank + rope_dim` values, no V."""
        a, n = self.args.attention, self.args.num_layers
        if isinstance(a, MLAShape):
            return KVSpec(n, 1, a.kv_lora_rank + a.rope_dim, 0, 0)
        return KVSpec(n, a.num_kv_heads, a.head_dim, a.num_kv_heads, a.head_dim, (a.window,) * n)

    @property
    def keeps_fp32_weights(self) -> bool:
        """Sigmoid routers keep their weight and correction bias in fp32 (HF's `_keep_in_fp32_modules`);
        the loader then hands us tensors as stored, cast only into each parameter's own dtype, so the bias
        is not rounded to bf16 on the way in."""
        return self.args.moe.router.scoring == "sigmoid"

    def set_latent_attention(self, latent: LatentAttention) -> None:
        """Switch the MLA decode mode (absorb / expand) of every layer; no effect on GQA models."""
        for layer in self.model.layers:
            if isinstance(layer.self_attn, MultiLatentAttention):
                layer.self_attn.impl = latent

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend
    ) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, positions, backend)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 logits for the rows that need them (sampling positions), into `out` if given."""
        if self.args.tie_embeddings:
            logits = F.linear(hidden, self.model.embed_tokens.weight)
            return logits.float() if out is None else out.copy_(logits)
        return logits_fp32(self.lm_head, hidden, out)

    def load_weights(
        self, tensors: Iterable[tuple[str, torch.Tensor]], expert_method: WeightMethod | None = None
    ) -> None:
        """HF-named tensors; routed experts per expert (`experts.{e}.gate_proj.weight`, as `save_pretrained`
        writes them) or fused (`experts.gate_up_proj`, as transformers v5 holds them in memory). With
        `expert_method` each expert stack is quantized as soon as its last tensor arrives: the routed
        experts are most of a MoE's weights, and a float copy of all of them never exists."""
        a = self.args
        shards = []  # gate/up halves need no shard: the loader splits every `gate_up_proj` in two
        if isinstance(a.attention, AttentionShape):
            q, kv = (
                a.attention.num_heads * a.attention.head_dim,
                a.attention.num_kv_heads * a.attention.head_dim,
            )
            shards = [
                Shard("qkv_proj", "q_proj", 0, q),
                Shard("qkv_proj", "k_proj", q, kv),
                Shard("qkv_proj", "v_proj", q + kv, kv),
            ]
        ignore = ("rotary_emb.inv_freq",) + (("lm_head.",) if a.tie_embeddings else ())
        filled = None if expert_method is None else partial(self._quantize_stack, expert_method)
        load_moe_weights(self, tensors, shards, a.num_layers, ignore, filled)

    def _quantize_stack(self, method: WeightMethod, name: str) -> None:
        """Quantize the parameter `name` if it is an expert stack (other parameters stay float)."""
        owner, _, leaf = name.rpartition(".")
        experts = self.get_submodule(owner)
        if isinstance(experts, FusedExperts) and leaf in EXPERT_STACKS:
            experts.quantize_weights(method, (leaf,))

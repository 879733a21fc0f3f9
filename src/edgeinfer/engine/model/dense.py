"""Dense decoder-only transformers: Llama, Qwen3 and Gemma 3 share this code, differing in `DenseArgs`."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from edgeinfer.engine.attention.backend import AttentionBackend
from edgeinfer.engine.attention.storage import KVSpec
from edgeinfer.engine.model.layers.attention import AttentionShape, SelfAttention
from edgeinfer.engine.model.layers.mlp import GatedMLP
from edgeinfer.engine.model.layers.norm import RMSNorm
from edgeinfer.engine.model.layers.rotary import RotaryEmbedding
from edgeinfer.engine.model.weights import Shard, load_weights
from edgeinfer.engine.quant.layers import logits_fp32

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _rounded(value: float, dtype: torch.dtype) -> float:
    """`value` rounded to `dtype` (on the CPU: models are built under a meta device)."""
    return torch.tensor(value, dtype=dtype, device="cpu").item()


@dataclass(frozen=True)
class DenseArgs:
    vocab_size: int
    hidden: int
    intermediate: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_eps: float
    act: str
    max_pos: int
    tie_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    qk_norm: bool
    rope: tuple[dict, ...]  # per layer
    windows: tuple[int | None, ...]  # per layer; None = global attention
    gemma_style: bool = False  # (1 + w) norms, sandwich norms, sqrt(hidden) embedding scale
    attn_scale: float | None = None
    final_softcap: float | None = None
    attn_softcap: float | None = None
    rope_interleaved: bool = False


class DecoderLayer(nn.Module):
    def __init__(self, idx: int, args: DenseArgs, rope: RotaryEmbedding) -> None:
        super().__init__()
        g = args.gemma_style
        shape = AttentionShape(
            hidden=args.hidden,
            num_heads=args.num_heads,
            num_kv_heads=args.num_kv_heads,
            head_dim=args.head_dim,
            bias=args.attention_bias,
            out_bias=args.attention_bias,  # as HF's Llama, Qwen3 and Gemma 3 build o_proj
            qk_norm=args.qk_norm,
            qk_norm_eps=args.rms_eps,
            qk_norm_unit_offset=g,
            scale=args.attn_scale,
            window=args.windows[idx],
            softcap=args.attn_softcap,
        )
        self.self_attn = SelfAttention(idx, shape, rope)
        self.mlp = GatedMLP(args.hidden, args.intermediate, args.act, args.mlp_bias)
        self.input_layernorm = RMSNorm(args.hidden, args.rms_eps, g)
        self.post_attention_layernorm = RMSNorm(args.hidden, args.rms_eps, g)
        self.sandwich = g
        if g:
            self.pre_feedforward_layernorm = RMSNorm(args.hidden, args.rms_eps, g)
            self.post_feedforward_layernorm = RMSNorm(args.hidden, args.rms_eps, g)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend) -> torch.Tensor:
        q, k, v = self.pre_attention(x, positions)
        return self.post_attention(x, self.self_attn.attend(q, k, v, backend))

    # Everything but the paged attention: pure tensor functions, which model/compile.py may compile.
    def pre_attention(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.self_attn.project(self.input_layernorm(x), positions)

    def post_attention(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        h = self.self_attn.output(attn)
        if self.sandwich:
            x = x + self.post_attention_layernorm(h)
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


class DenseCausalLM(nn.Module):
    """Flat-batch forward: `input_ids` [T] of all scheduled sequences concatenated; the backend knows
    where each sequence starts and which cache blocks it owns."""

    def __init__(self, args: DenseArgs) -> None:
        super().__init__()
        self.args = args
        ropes = {}
        for params in args.rope:
            key = repr(sorted(params.items()))
            if key not in ropes:
                dim = int(args.head_dim * float(params.get("partial_rotary_factor", 1.0)))
                ropes[key] = RotaryEmbedding(dim, params, args.max_pos, args.rope_interleaved)
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(args.vocab_size, args.hidden)
        self.model.layers = nn.ModuleList(
            DecoderLayer(i, args, ropes[repr(sorted(p.items()))]) for i, p in enumerate(args.rope)
        )
        self.model.norm = RMSNorm(args.hidden, args.rms_eps, args.gemma_style)
        # A module even when tied (sharing the embedding's Parameter), so weight quantization reaches it.
        self.lm_head = nn.Linear(
            args.hidden, args.vocab_size, bias=False, device="meta" if args.tie_embeddings else None
        )
        if args.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # Gemma scales embeddings by sqrt(hidden) rounded to the model dtype, as HF does; kept as a float
        # per dtype (exact in each, so the product is HF's bit for bit): a tensor made inside forward would
        # be a `torch.tensor` call in a compiled graph, which AOTAutograd's cache refuses to store.
        self.embed_scale = {dt: _rounded(args.hidden**0.5, dt) for dt in _FLOAT_DTYPES}

    @property
    def kv_spec(self) -> KVSpec:
        a = self.args
        return KVSpec(a.num_layers, a.num_kv_heads, a.head_dim, a.num_kv_heads, a.head_dim, a.windows)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend
    ) -> torch.Tensor:
        x = self.embed(input_ids)
        for layer in self.model.layers:
            x = layer(x, positions, backend)
        return self.model.norm(x)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        return x * self.embed_scale[x.dtype] if self.args.gemma_style else x

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 logits for the rows that need them (sampling positions), into `out` if given."""
        logits = logits_fp32(self.lm_head, hidden, out)
        if self.args.final_softcap:
            cap = self.args.final_softcap  # in place: `logits` may be the caller's buffer
            logits = logits.div_(cap).tanh_().mul_(cap)
        return logits

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        a = self.args
        q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        shards = [
            Shard("qkv_proj", "q_proj", 0, q),
            Shard("qkv_proj", "k_proj", q, kv),
            Shard("qkv_proj", "v_proj", q + kv, kv),
            Shard("gate_up_proj", "gate_proj", 0, a.intermediate),
            Shard("gate_up_proj", "up_proj", a.intermediate, a.intermediate),
        ]
        ignore = ("rotary_emb.inv_freq",) + (("lm_head.",) if a.tie_embeddings else ())
        load_weights(self, tensors, shards, ignore)

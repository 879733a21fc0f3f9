"""HF configs of the dense families → `DenseArgs`."""

from __future__ import annotations

from typing import Any

from edgeinfer.engine.model import hf_config as hc
from edgeinfer.engine.model.dense import DenseArgs


def _common(cfg: dict[str, Any], **overrides: Any) -> DenseArgs:
    types = hc.layer_types(cfg)
    window = cfg.get("sliding_window")
    fields: dict[str, Any] = dict(
        vocab_size=hc.require(cfg, "vocab_size"),
        hidden=hc.require(cfg, "hidden_size"),
        intermediate=hc.require(cfg, "intermediate_size"),
        num_layers=hc.require(cfg, "num_hidden_layers"),
        num_heads=hc.require(cfg, "num_attention_heads"),
        num_kv_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
        head_dim=hc.head_dim(cfg),
        rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        act=cfg.get("hidden_act") or cfg.get("hidden_activation") or "silu",
        max_pos=int(cfg.get("max_position_embeddings", 4096)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", False)),
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        qk_norm=False,
        rope=tuple(hc.rope_params(cfg, t) for t in types),
        windows=tuple(window if t == "sliding_attention" else None for t in types),
    )
    fields.update(overrides)
    return DenseArgs(**fields)


def llama_args(cfg: dict[str, Any]) -> DenseArgs:
    return _common(cfg)


def qwen3_args(cfg: dict[str, Any]) -> DenseArgs:
    return _common(cfg, qk_norm=True)


def gemma3_args(cfg: dict[str, Any]) -> DenseArgs:
    return _common(
        cfg,
        act=cfg.get("hidden_activation") or "gelu_pytorch_tanh",
        tie_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        qk_norm=True,
        gemma_style=True,
        attn_scale=float(cfg.get("query_pre_attn_scalar", hc.head_dim(cfg))) ** -0.5,
        final_softcap=cfg.get("final_logit_softcapping"),
        attn_softcap=cfg.get("attn_logit_softcapping"),
    )

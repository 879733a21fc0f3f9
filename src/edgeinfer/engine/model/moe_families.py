"""HF configs of the MoE families → `MoeArgs`.

A key that is absent takes transformers' default for that family; a key whose value we cannot run
(another router scoring, another top-k method, a rope type we lack, ...) raises `ConfigError` naming it.
See docs/models/{qwen3_moe,glm4_moe,deepseek_v3}.md for every key read.
"""

from __future__ import annotations

import math
from typing import Any

from edgeinfer.engine.model import hf_config as hc
from edgeinfer.engine.model.hf_config import ConfigError
from edgeinfer.engine.model.layers.activation import get_activation
from edgeinfer.engine.model.layers.attention import AttentionShape
from edgeinfer.engine.model.mla import MLAShape
from edgeinfer.engine.model.moe import MoeSpec
from edgeinfer.engine.model.moe_lm import MoeArgs
from edgeinfer.engine.model.routing import RouterSpec

_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def qwen3_moe_args(cfg: dict[str, Any]) -> MoeArgs:
    """Qwen3-MoE: softmax top-k routing, no shared experts, QK-norm; dense layers from `mlp_only_layers`
    and `decoder_sparse_step`."""
    _expect(cfg, "scoring_func", "softmax")
    n = hc.require(cfg, "num_hidden_layers")
    num_experts = _first(cfg, "num_experts", "num_local_experts")
    only_dense = set(cfg.get("mlp_only_layers") or ())
    step = int(cfg.get("decoder_sparse_step", 1))
    sparse = tuple(i not in only_dense and (i + 1) % step == 0 for i in range(n))
    router = _router(cfg, num_experts, "softmax", norm_default=False)
    rope = _rope(cfg)
    bias = bool(cfg.get("attention_bias", False))
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
    attn = _gqa(cfg, bias=bias, out_bias=bias, qk_norm=True, window=window)
    return _args(cfg, attn, rope, int(attn.head_dim * hc.partial_rotary(cfg, rope)), False, router, 0, sparse)


def glm4_moe_args(cfg: dict[str, Any]) -> MoeArgs:
    """GLM-4.5 / 4.6: grouped sigmoid routing with shared experts, partial rotary (default 0.5),
    optional QK-norm, bias on q/k/v (not on o_proj)."""
    _check_noaux_tc(cfg)
    num_experts = _first(cfg, "n_routed_experts", "num_local_experts")
    router = _router(
        cfg, num_experts, "sigmoid", norm_default=True, groups_default=(1, 1), scaling_default=1.0
    )
    rope = _rope(cfg)
    partial = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.5)))
    bias, qk_norm = bool(cfg.get("attention_bias", False)), bool(cfg.get("use_qk_norm", False))
    attn = _gqa(cfg, bias=bias, out_bias=False, qk_norm=qk_norm, eps=1e-5)
    sparse = _after_dense(cfg, default=1)
    shared = _shared(cfg)
    return _args(cfg, attn, rope, int(attn.head_dim * partial), False, router, shared, sparse, eps=1e-5)


def deepseek_v3_args(cfg: dict[str, Any]) -> MoeArgs:
    """DeepSeek-V3 and Kimi K2 (`model_type` deepseek_v3 / kimi_k2): MLA attention, grouped sigmoid
    (`noaux_tc`) routing with shared experts."""
    _check_noaux_tc(cfg)
    num_experts = _first(cfg, "n_routed_experts", "num_local_experts")
    router = _router(
        cfg, num_experts, "sigmoid", norm_default=True, groups_default=(8, 4), scaling_default=2.5
    )
    rope = _rope(cfg)
    if "q_lora_rank" not in cfg:
        raise ConfigError("config.json lacks required key 'q_lora_rank' (null for a full-rank q_proj)")
    q_lora = cfg["q_lora_rank"]
    nope, rope_dim = hc.require(cfg, "qk_nope_head_dim"), hc.require(cfg, "qk_rope_head_dim")
    attn = MLAShape(
        hidden=hc.require(cfg, "hidden_size"),
        num_heads=hc.require(cfg, "num_attention_heads"),
        q_lora_rank=int(q_lora) if q_lora else None,
        kv_lora_rank=hc.require(cfg, "kv_lora_rank"),
        nope_dim=nope,
        rope_dim=rope_dim,
        v_dim=hc.require(cfg, "v_head_dim"),
        bias=bool(cfg.get("attention_bias", False)),
        scale=_mla_scale(nope + rope_dim, rope),
    )
    interleave = bool(cfg.get("rope_interleave", True))
    return _args(cfg, attn, rope, rope_dim, interleave, router, _shared(cfg), _after_dense(cfg, default=3))


# ---- shared pieces -------------------------------------------------------------------------------------
def _args(
    cfg: dict[str, Any],
    attention: AttentionShape | MLAShape,
    rope: dict[str, Any],
    rope_dim: int,
    interleaved: bool,
    router: RouterSpec,
    shared: int,
    sparse: tuple[bool, ...],
    eps: float = 1e-6,
) -> MoeArgs:
    hidden, act = hc.require(cfg, "hidden_size"), cfg.get("hidden_act", "silu")
    try:
        get_activation(act)
    except ValueError as e:
        raise ConfigError(f"hidden_act: {e}") from None
    moe = MoeSpec(hidden, hc.require(cfg, "moe_intermediate_size"), shared, act, router)
    return MoeArgs(
        vocab_size=hc.require(cfg, "vocab_size"),
        hidden=hidden,
        intermediate=hc.require(cfg, "intermediate_size"),
        num_layers=len(sparse),
        rms_eps=float(cfg.get("rms_norm_eps", eps)),
        act=act,
        max_pos=int(cfg.get("max_position_embeddings", 4096)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention=attention,
        rope=rope,
        rope_dim=rope_dim,
        rope_interleaved=interleaved,
        moe=moe,
        sparse_layers=sparse,
    )


def _gqa(
    cfg: dict[str, Any],
    bias: bool,
    out_bias: bool,
    qk_norm: bool,
    window: int | None = None,
    eps: float = 1e-6,
) -> AttentionShape:
    heads = hc.require(cfg, "num_attention_heads")
    return AttentionShape(
        hidden=hc.require(cfg, "hidden_size"),
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=hc.head_dim(cfg),
        bias=bias,
        out_bias=out_bias,
        qk_norm=qk_norm,
        qk_norm_eps=float(cfg.get("rms_norm_eps", eps)),
        window=window,
    )


def _router(
    cfg: dict[str, Any],
    num_experts: int,
    scoring: str,
    norm_default: bool,
    groups_default: tuple[int, int] = (1, 1),
    scaling_default: float = 1.0,
) -> RouterSpec:
    top_k = hc.require(cfg, "num_experts_per_tok")
    if not 0 < top_k <= num_experts:
        raise ConfigError(
            f"num_experts_per_tok {top_k} must be in [1, {num_experts}] (the number of experts)"
        )
    n_group, topk_group = 1, 1  # softmax routers do not group
    if scoring == "sigmoid":
        n_group = int(cfg.get("n_group") or groups_default[0])
        topk_group = int(cfg.get("topk_group") or groups_default[1])
    if num_experts % n_group:
        raise ConfigError(f"n_group {n_group} does not divide the {num_experts} experts")
    if not 0 < topk_group <= n_group:
        raise ConfigError(f"topk_group {topk_group} must be in [1, n_group={n_group}]")
    if topk_group < n_group and num_experts // n_group < 2:
        raise ConfigError(f"n_group {n_group}: groups need at least 2 experts (a group scores its best two)")
    return RouterSpec(
        num_experts=num_experts,
        top_k=top_k,
        scoring=scoring,
        norm_topk_prob=bool(cfg.get("norm_topk_prob", norm_default)),
        n_group=n_group,
        topk_group=topk_group,
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", scaling_default)),
    )


def _check_noaux_tc(cfg: dict[str, Any]) -> None:
    """DeepSeek-V3 style routing is the only one these families run: sigmoid scores, `noaux_tc` top-k,
    a MoE block in every layer after the first `first_k_dense_replace`."""
    _expect(cfg, "scoring_func", "sigmoid")
    _expect(cfg, "topk_method", "noaux_tc")
    _expect(cfg, "moe_layer_freq", 1)


def _expect(cfg: dict[str, Any], key: str, supported: Any) -> None:
    if key in cfg and cfg[key] is not None and cfg[key] != supported:
        raise ConfigError(
            f"unsupported {key} {cfg[key]!r} for {cfg['architectures'][0]} (supported: {supported!r})"
        )


def _first(cfg: dict[str, Any], *keys: str) -> int:
    for key in keys:
        if cfg.get(key) is not None:
            if int(cfg[key]) < 1:
                raise ConfigError(f"{key} must be >= 1, got {cfg[key]}")
            return int(cfg[key])
    raise ConfigError(f"config.json lacks required key {keys[0]!r}")


def _after_dense(cfg: dict[str, Any], default: int) -> tuple[bool, ...]:
    first_dense = cfg.get("first_k_dense_replace")
    first_dense = default if first_dense is None else int(first_dense)
    return tuple(i >= first_dense for i in range(hc.require(cfg, "num_hidden_layers")))


def _shared(cfg: dict[str, Any]) -> int:
    n_shared = cfg.get("n_shared_experts")
    return int(1 if n_shared is None else n_shared) * hc.require(cfg, "moe_intermediate_size")


def _rope(cfg: dict[str, Any]) -> dict[str, Any]:
    params = hc.rope_params(cfg)
    rope_type = params.get("rope_type", "default")
    if rope_type not in _ROPE_TYPES:
        raise ConfigError(f"unsupported rope_type {rope_type!r} (supported: {', '.join(_ROPE_TYPES)})")
    if params.get("truncate") is False:
        raise ConfigError("unsupported rope_parameters.truncate false (YaRN with an untruncated ramp)")
    if rope_type == "yarn" and not params.get("factor"):
        raise ConfigError("rope_parameters of type yarn lack 'factor'")
    return params


def _mla_scale(qk_dim: int, rope: dict[str, Any]) -> float:
    """Softmax scale: qk_dim^-0.5, times mscale(factor, mscale_all_dim)² under YaRN (HF's yarn_apply_mscale;
    the rope's cos/sin carry the other mscale ratio)."""
    scale = qk_dim**-0.5
    all_dim = rope.get("mscale_all_dim")
    factor = float(rope.get("factor") or 1.0)
    if rope.get("rope_type", "default") != "default" and all_dim and factor > 1:
        m = 0.1 * all_dim * math.log(factor) + 1.0
        scale *= m * m
    return scale

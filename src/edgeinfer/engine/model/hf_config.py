"""Reading HF config.json dicts: the few conventions every family shares."""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A checkpoint config the engine cannot serve; the message names the key."""


def require(cfg: dict[str, Any], key: str) -> Any:
    if key not in cfg or cfg[key] is None:
        raise ConfigError(f"config.json lacks required key {key!r}")
    return cfg[key]


def head_dim(cfg: dict[str, Any]) -> int:
    return int(cfg.get("head_dim") or require(cfg, "hidden_size") // require(cfg, "num_attention_heads"))


def layer_types(cfg: dict[str, Any]) -> list[str]:
    n = require(cfg, "num_hidden_layers")
    types = cfg.get("layer_types")
    if types is None:
        return ["full_attention"] * n
    if len(types) != n:
        raise ConfigError(f"layer_types has {len(types)} entries for {n} layers")
    unknown = set(types) - {"full_attention", "sliding_attention"}
    if unknown:
        raise ConfigError(f"unsupported layer_types {sorted(unknown)}")
    return list(types)


def rope_params(cfg: dict[str, Any], layer_type: str = "full_attention") -> dict[str, Any]:
    """Rope parameters for a layer type, from transformers v5 `rope_parameters` (flat, or keyed by layer
    type as Gemma 3 has it) or the older `rope_theta` + `rope_scaling`."""
    params = cfg.get("rope_parameters")
    if params and layer_type in params:
        return dict(params[layer_type])
    if params and "rope_type" in params:
        return dict(params)
    out: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.get("rope_theta", 10000.0)}
    if layer_type == "sliding_attention" and cfg.get("rope_local_base_freq") is not None:
        return {"rope_type": "default", "rope_theta": cfg["rope_local_base_freq"]}
    scaling = cfg.get("rope_scaling")
    if scaling:
        out.update(scaling)
        out["rope_type"] = scaling.get("rope_type", scaling.get("type", "default"))
    return out


def partial_rotary(cfg: dict[str, Any], params: dict[str, Any]) -> float:
    return float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))

"""`adapter_config.json` of a PEFT LoRA adapter: parsed and checked before any weight is read (no torch).

Only what changes the served output is accepted; a setting we cannot honour is refused with a one-line
reason rather than ignored, so an adapter either serves as PEFT would run it or does not register."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MAX_RANK = 64
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_MAX_CONFIG_BYTES = 1 << 20

# HF's names of the projections an adapter may target (dense decoder layers of Llama, Qwen3, Gemma 3).
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class AdapterError(ValueError):
    """An adapter that cannot be served: the message says why, in one line."""


@dataclass(frozen=True)
class AdapterConfig:
    rank: int
    alpha: float
    use_rslora: bool
    target_modules: frozenset[str]
    base_model: str | None

    @property
    def scale(self) -> float:
        """PEFT's scaling of `B @ A`: alpha / r, or alpha / sqrt(r) with rank-stabilised LoRA."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


def read_config(directory: Path) -> AdapterConfig:
    path = directory / CONFIG_FILE
    if not path.is_file():
        raise AdapterError(f"{directory} has no {CONFIG_FILE}")
    if path.stat().st_size > _MAX_CONFIG_BYTES:
        raise AdapterError(f"{CONFIG_FILE} is over {_MAX_CONFIG_BYTES} bytes")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AdapterError(f"{CONFIG_FILE} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise AdapterError(f"{CONFIG_FILE} must hold a JSON object")
    return parse_config(raw)


def parse_config(raw: dict[str, Any]) -> AdapterConfig:
    if raw.get("peft_type") != "LORA":
        raise AdapterError(f"peft_type must be 'LORA', not {raw.get('peft_type')!r}")
    _refuse_unsupported(raw)
    rank = raw.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise AdapterError(f"r must be a positive integer, not {rank!r}")
    if rank > MAX_RANK:
        raise AdapterError(f"rank r={rank} is over the limit of {MAX_RANK}")
    alpha = raw.get("lora_alpha")
    number = isinstance(alpha, (int, float)) and not isinstance(alpha, bool)
    if not number or not math.isfinite(alpha) or alpha <= 0:
        raise AdapterError(f"lora_alpha must be a positive number, not {alpha!r}")
    rslora = raw.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise AdapterError(f"use_rslora must be true or false, not {rslora!r}")
    base = raw.get("base_model_name_or_path")
    if base is not None and not isinstance(base, str):
        raise AdapterError("base_model_name_or_path must be a string")
    return AdapterConfig(rank, float(alpha), rslora, _targets(raw.get("target_modules")), base)


def _targets(value: Any) -> frozenset[str]:
    if value == "all-linear":
        return frozenset(PROJECTIONS)
    if isinstance(value, str):
        raise AdapterError("target_modules as a regular expression is not supported; list the projections")
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        raise AdapterError("target_modules must be a non-empty list of module names")
    for name in value:
        if name.rsplit(".", 1)[-1] not in PROJECTIONS:
            raise AdapterError(f"target module {name!r} is not one of the base's projections {PROJECTIONS}")
    return frozenset(v.rsplit(".", 1)[-1] for v in value)


def _refuse_unsupported(raw: dict[str, Any]) -> None:
    """Settings that change what the adapter computes and that the engine does not implement."""
    if raw.get("use_dora"):
        raise AdapterError("DoRA adapters (use_dora) are not supported")
    if raw.get("bias", "none") != "none":
        raise AdapterError(f"bias={raw.get('bias')!r} is not supported (only 'none')")
    if raw.get("fan_in_fan_out"):
        raise AdapterError("fan_in_fan_out adapters are not supported")
    if raw.get("modules_to_save"):
        raise AdapterError("modules_to_save (fully trained modules) is not supported")
    for key in ("rank_pattern", "alpha_pattern"):
        if raw.get(key):
            raise AdapterError(f"per-module {key} is not supported")

"""Model registry keyed by the checkpoint's `architectures`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from edgeinfer.engine.model.dense import DenseCausalLM
from edgeinfer.engine.model.families import gemma3_args, llama_args, qwen3_args
from edgeinfer.engine.model.hf_config import ConfigError

ModelBuilder = Callable[[dict[str, Any]], nn.Module]

_REGISTRY: dict[str, ModelBuilder] = {
    "LlamaForCausalLM": lambda cfg: DenseCausalLM(llama_args(cfg)),
    "MistralForCausalLM": lambda cfg: DenseCausalLM(llama_args(cfg)),
    "Qwen3ForCausalLM": lambda cfg: DenseCausalLM(qwen3_args(cfg)),
    "Gemma3ForCausalLM": lambda cfg: DenseCausalLM(gemma3_args(cfg)),
}


def register_model(architecture: str, builder: ModelBuilder) -> None:
    _REGISTRY[architecture] = builder


def supported_architectures() -> list[str]:
    return sorted(_REGISTRY)


def build_model(cfg: dict[str, Any]) -> nn.Module:
    """Instantiate (uninitialised) the model a config describes."""
    archs = cfg.get("architectures") or []
    for arch in archs:
        if arch in _REGISTRY:
            return _REGISTRY[arch](cfg)
    raise ConfigError(
        f"unsupported architecture {archs or '(none given)'}; "
        f"supported: {', '.join(supported_architectures())}"
    )

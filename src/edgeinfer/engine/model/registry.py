"""Model registry keyed by the checkpoint's `architectures`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from edgeinfer.engine.model.dense import DenseCausalLM
from edgeinfer.engine.model.families import gemma3_args, llama_args, qwen3_args
from edgeinfer.engine.model.hf_config import ConfigError
from edgeinfer.engine.model.moe_families import deepseek_v3_args, glm4_moe_args, qwen3_moe_args
from edgeinfer.engine.model.moe_lm import MoeCausalLM

ModelBuilder = Callable[[dict[str, Any]], nn.Module]

_REGISTRY: dict[str, ModelBuilder] = {
    "LlamaForCausalLM": lambda cfg: DenseCausalLM(llama_args(cfg)),
    "MistralForCausalLM": lambda cfg: DenseCausalLM(llama_args(cfg)),
    "Qwen3ForCausalLM": lambda cfg: DenseCausalLM(qwen3_args(cfg)),
    "Gemma3ForCausalLM": lambda cfg: DenseCausalLM(gemma3_args(cfg)),
    "Qwen3MoeForCausalLM": lambda cfg: MoeCausalLM(qwen3_moe_args(cfg)),
    "Glm4MoeForCausalLM": lambda cfg: MoeCausalLM(glm4_moe_args(cfg)),
    # Kimi K2 ships as this architecture (model_type kimi_k2); the config keys are the same.
    "DeepseekV3ForCausalLM": lambda cfg: MoeCausalLM(deepseek_v3_args(cfg)),
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

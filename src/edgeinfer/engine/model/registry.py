"""Model registry keyed by the checkpoint's `architectures`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from edgeinfer.engine.attention.registry import DEFAULT_MLA_MODE
from edgeinfer.engine.model.dense import DenseCausalLM
from edgeinfer.engine.model.families import gemma3_args, llama_args, qwen3_args
from edgeinfer.engine.model.hf_config import ConfigError
from edgeinfer.engine.model.moe_families import deepseek_v3_args, glm4_moe_args, qwen3_moe_args
from edgeinfer.engine.model.moe_lm import MoeCausalLM

# (the checkpoint's HF config, the MLA decode mode) -> the model; models without MLA ignore the mode.
ModelBuilder = Callable[[dict[str, Any], str], nn.Module]

_REGISTRY: dict[str, ModelBuilder] = {
    "LlamaForCausalLM": lambda cfg, _: DenseCausalLM(llama_args(cfg)),
    "MistralForCausalLM": lambda cfg, _: DenseCausalLM(llama_args(cfg)),
    "Qwen3ForCausalLM": lambda cfg, _: DenseCausalLM(qwen3_args(cfg)),
    "Gemma3ForCausalLM": lambda cfg, _: DenseCausalLM(gemma3_args(cfg)),
    "Qwen3MoeForCausalLM": lambda cfg, mla: MoeCausalLM(qwen3_moe_args(cfg), mla),
    "Glm4MoeForCausalLM": lambda cfg, mla: MoeCausalLM(glm4_moe_args(cfg), mla),
    # Kimi K2 ships as this architecture (model_type kimi_k2); the config keys are the same.
    "DeepseekV3ForCausalLM": lambda cfg, mla: MoeCausalLM(deepseek_v3_args(cfg), mla),
}


def register_model(architecture: str, builder: ModelBuilder) -> None:
    _REGISTRY[architecture] = builder


def supported_architectures() -> list[str]:
    return sorted(_REGISTRY)


def build_model(cfg: dict[str, Any], mla_mode: str = DEFAULT_MLA_MODE) -> nn.Module:
    """Instantiate (uninitialised) the model a config describes; MLA layers decode in `mla_mode`."""
    archs = cfg.get("architectures") or []
    for arch in archs:
        if arch in _REGISTRY:
            return _REGISTRY[arch](cfg, mla_mode)
    raise ConfigError(
        f"unsupported architecture {archs or '(none given)'}; "
        f"supported: {', '.join(supported_architectures())}"
    )

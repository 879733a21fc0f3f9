"""Per-architecture knowledge for GGUF files: the HF config they imply, HF tensor names, and the changes
llama.cpp's converter made to tensors that must be undone to get the HF checkpoint's values back.

Registry keyed by `general.architecture`. Adding a family means one subclass: its tensor-name table, its
config keys, and `restore` for whatever the converter did to its tensors.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from typing import Any, ClassVar

import numpy as np

from edgeinfer.engine.model.loader.errors import CheckpointError
from edgeinfer.engine.model.loader.gguf_meta import ArchMetadata, f32
from edgeinfer.engine.model.loader.gguf_rope import llama3_rope_scaling

_TOP_LEVEL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Block tensors every llama-like family names the same way.
_COMMON_BLOCK = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


class GGUFArchitecture(ABC):
    """How one `general.architecture` maps onto a transformers model."""

    hf_architecture: ClassVar[str]
    model_type: ClassVar[str]
    block_names: ClassVar[dict[str, str]]
    # Tensors that hold configuration rather than weights: read while building the config, never yielded.
    config_tensors: ClassVar[tuple[str, ...]] = ()

    @abstractmethod
    def family_config(self, meta: ArchMetadata, tensors: dict[str, np.ndarray]) -> dict[str, Any]:
        """Config keys specific to this family (the shared ones come from `base_config`); `tensors` holds
        whichever of `config_tensors` the file has."""

    def restore(self, gguf_name: str, values: np.ndarray, config: dict[str, Any]) -> np.ndarray:
        """Undo what llama.cpp's converter did to this tensor (nothing, unless a family says otherwise)."""
        return values

    def config(
        self, meta: ArchMetadata, tensor_names: set[str], tensors: dict[str, np.ndarray]
    ) -> dict[str, Any]:
        return {**base_config(self, meta, tensor_names), **self.family_config(meta, tensors)}

    def hf_name(self, gguf_name: str) -> str | None:
        """The HF name of a GGUF tensor, or None for one that is not a model weight."""
        if gguf_name in _TOP_LEVEL:
            return _TOP_LEVEL[gguf_name]
        match = _BLOCK.fullmatch(gguf_name)
        if match and match[2] in self.block_names:
            return f"model.layers.{match[1]}.{self.block_names[match[2]]}.{match[3]}"
        return None


def base_config(arch: GGUFArchitecture, meta: ArchMetadata, tensor_names: set[str]) -> dict[str, Any]:
    """The keys every llama-like family shares, named as HF's config.json names them."""
    hidden = int(meta.require("embedding_length"))
    heads = meta.uniform_int("attention.head_count")
    return {
        "architectures": [arch.hf_architecture],
        "model_type": arch.model_type,
        "vocab_size": meta.vocab_size(),
        "hidden_size": hidden,
        "intermediate_size": meta.uniform_int("feed_forward_length"),
        "num_hidden_layers": int(meta.require("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": meta.uniform_int("attention.head_count_kv", heads),
        "head_dim": head_dim_of(meta),
        "rms_norm_eps": f32(meta.require("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(meta.require("context_length")),
        "rope_scaling": rope_scaling(meta),
        # llama.cpp drops `output.weight` when the model ties it to the embeddings.
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": meta.token("bos"),
        "eos_token_id": meta.token("eos"),
        "pad_token_id": meta.token("padding"),
    }


def head_dim_of(meta: ArchMetadata) -> int:
    hidden, heads = int(meta.require("embedding_length")), meta.uniform_int("attention.head_count")
    return int(meta.get("attention.key_length") or meta.get("rope.dimension_count") or hidden // heads)


def rope_scaling(meta: ArchMetadata) -> dict[str, Any] | None:
    """HF `rope_scaling` from `<arch>.rope.scaling.*` (linear and YaRN; none is the common case)."""
    kind = meta.get("rope.scaling.type", "none")
    factor = meta.get("rope.scaling.factor")
    if kind == "none" or factor is None or f32(factor) == 1.0:
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": f32(factor)}
    if kind == "yarn":
        original = meta.get("rope.scaling.original_context_length")
        scaling: dict[str, Any] = {"rope_type": "yarn", "factor": f32(factor)}
        if original is not None:
            scaling["original_max_position_embeddings"] = int(original)
        return scaling
    raise CheckpointError(f"{meta.path}: unsupported rope scaling type {kind!r} (linear, yarn)")


class LlamaArchitecture(GGUFArchitecture):
    hf_architecture = "LlamaForCausalLM"
    model_type = "llama"
    block_names: ClassVar[dict[str, str]] = {**_COMMON_BLOCK, "ffn_norm": "post_attention_layernorm"}
    config_tensors = ("rope_freqs.weight",)

    def family_config(self, meta: ArchMetadata, tensors: dict[str, np.ndarray]) -> dict[str, Any]:
        config = {
            "rope_theta": f32(meta.get("rope.freq_base", 10000.0)),
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
        }
        if "rope_freqs.weight" in tensors:  # Llama 3.1+: the rope schedule is stored as a tensor
            head_dim = head_dim_of(meta)
            divisors = tensors["rope_freqs.weight"]
            config["rope_scaling"] = llama3_rope_scaling(divisors, config["rope_theta"], head_dim, meta.path)
        return config

    def restore(self, gguf_name: str, values: np.ndarray, config: dict[str, Any]) -> np.ndarray:
        # llama.cpp reorders the rows of Q and K within each head from HF's "rotate half" layout to the
        # interleaved pairs its rope kernel wants; put them back.
        if gguf_name.endswith(".attn_q.weight") or gguf_name.endswith(".attn_q.bias"):
            return unpermute_rope_rows(values, config["num_attention_heads"])
        if gguf_name.endswith(".attn_k.weight") or gguf_name.endswith(".attn_k.bias"):
            return unpermute_rope_rows(values, config["num_key_value_heads"])
        return values


def unpermute_rope_rows(values: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute`: within each head, rows (2i, 2i+1) go back to (i, i + half)."""
    rows = values.shape[0]
    half = rows // n_heads // 2
    return values.reshape(n_heads, half, 2, *values.shape[1:]).swapaxes(1, 2).reshape(values.shape)


class Gemma3Architecture(GGUFArchitecture):
    hf_architecture = "Gemma3ForCausalLM"
    model_type = "gemma3_text"
    block_names: ClassVar[dict[str, str]] = {
        **_COMMON_BLOCK,
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    }
    # llama.cpp hard-codes these for Gemma 3 instead of storing them (llama-model.cpp, LLM_ARCH_GEMMA3).
    _DEFAULT_SWA_PERIOD = 6
    _DEFAULT_LOCAL_ROPE_THETA = 10000.0
    _LAYERS_27B = 62

    def family_config(self, meta: ArchMetadata, tensors: dict[str, np.ndarray]) -> dict[str, Any]:
        hidden, heads = int(meta.require("embedding_length")), meta.uniform_int("attention.head_count")
        layers = int(meta.require("block_count"))
        head_dim = head_dim_of(meta)
        return {
            "rope_theta": f32(meta.get("rope.freq_base", 1_000_000.0)),
            "rope_local_base_freq": f32(meta.get("rope.freq_base_swa", self._DEFAULT_LOCAL_ROPE_THETA)),
            **self._sliding_window(meta, layers),
            # llama.cpp scales queries by 1/sqrt(hidden/heads) for the 27B and by 1/sqrt(head_dim) otherwise,
            # matching the query_pre_attn_scalar Google ships in each model's config.json.
            "query_pre_attn_scalar": hidden // heads if layers == self._LAYERS_27B else head_dim,
            "final_logit_softcapping": _optional_f32(meta.get("final_logit_softcapping")),
            "attn_logit_softcapping": _optional_f32(meta.get("attn_logit_softcapping")),
            "hidden_activation": "gelu_pytorch_tanh",
            "attention_bias": False,
        }

    def _sliding_window(self, meta: ArchMetadata, layers: int) -> dict[str, Any]:
        window = meta.get("attention.sliding_window")
        if not window:
            return {"sliding_window": None, "layer_types": ["full_attention"] * layers}
        pattern = meta.get("attention.sliding_window_pattern", self._DEFAULT_SWA_PERIOD)
        if isinstance(pattern, list):  # one flag per layer: True means sliding
            if len(pattern) != layers:
                raise CheckpointError(f"{meta.path}: {len(pattern)} sliding-window flags for {layers} layers")
            kinds = ["sliding_attention" if flag else "full_attention" for flag in pattern]
            return {"sliding_window": int(window), "layer_types": kinds}
        period = int(pattern)
        kinds = ["full_attention" if (i + 1) % period == 0 else "sliding_attention" for i in range(layers)]
        return {"sliding_window": int(window), "sliding_window_pattern": period, "layer_types": kinds}

    def restore(self, gguf_name: str, values: np.ndarray, config: dict[str, Any]) -> np.ndarray:
        # Gemma's RMSNorm multiplies by (1 + w); llama.cpp stores w + 1 so that its generic norm applies.
        # Subtract in float32, before any cast, so the HF value comes back exactly as transformers has it.
        if gguf_name.endswith("norm.weight"):
            return values - np.float32(1.0)
        return values


def _optional_f32(value: float | None) -> float | None:
    return None if value is None else f32(value)


ARCHITECTURES: dict[str, GGUFArchitecture] = {
    "llama": LlamaArchitecture(),
    "gemma3": Gemma3Architecture(),
}


def architecture_for(meta: ArchMetadata) -> GGUFArchitecture:
    try:
        return ARCHITECTURES[meta.arch]
    except KeyError:
        supported = ", ".join(sorted(ARCHITECTURES))
        raise CheckpointError(
            f"{meta.path}: unsupported GGUF architecture {meta.arch!r} (supported: {supported})"
        ) from None

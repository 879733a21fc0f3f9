"""Tiny random HF models and GGUF files written from them the way llama.cpp's converter writes them.

The converter's changes (Q/K row permutation for Llama, `w + 1` norms for Gemma, dropping a tied
`output.weight`, quantizing) are redone here independently of the loader, so that the loader's undoing of
them is tested against a second implementation and against transformers' own GGUF loader.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize
from transformers import AutoConfig, AutoModelForCausalLM

VOCAB_SIZE = 320
BOS, EOS, UNK, PAD = 1, 2, 0, 3

_COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    vocab_size=VOCAB_SIZE,
    bos_token_id=BOS,
    eos_token_id=EOS,
    pad_token_id=PAD,
)
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": dict(model_type="llama", rope_theta=500000.0, tie_word_embeddings=False),
    "gemma3": dict(
        model_type="gemma3_text",
        head_dim=32,
        # Six layers, so that llama.cpp's fixed Gemma 3 pattern (every 6th layer global) matches HF's default.
        num_hidden_layers=6,
        sliding_window=16,
        rope_theta=1000000.0,
        rope_local_base_freq=10000.0,
        query_pre_attn_scalar=32,
        tie_word_embeddings=True,
    ),
}
_HF_TO_GGUF_BLOCK = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_FAMILY_BLOCK = {
    "llama": {"post_attention_layernorm": "ffn_norm"},
    "gemma3": {
        "post_attention_layernorm": "post_attention_norm",
        "pre_feedforward_layernorm": "ffn_norm",
        "post_feedforward_layernorm": "post_ffw_norm",
    },
}
# A mix of storage types, as a real quantized file has: every 2-D weight picks one by its role.
_WEIGHT_TYPES = {
    "attn_q": GGMLQuantizationType.Q8_0,
    "attn_k": GGMLQuantizationType.Q5_0,
    "attn_v": GGMLQuantizationType.Q4_1,
    "attn_output": GGMLQuantizationType.BF16,
    "ffn_gate": GGMLQuantizationType.Q8_0,
    "ffn_up": GGMLQuantizationType.F16,
    "ffn_down": GGMLQuantizationType.Q8_0,
    "token_embd": GGMLQuantizationType.Q8_0,
    "output": GGMLQuantizationType.F16,
}


def tiny_hf_model(family: str, seed: int = 0) -> torch.nn.Module:
    """A random fp32 transformers model of `family` with random (not constant) norm weights."""
    fields = {**_COMMON, **FAMILIES[family]}
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(0.0, 0.5)
    return model.eval()


def write_gguf(path: Path, family: str, model: torch.nn.Module, quantized: bool = True) -> Path:
    """Write `model` as llama.cpp's converter would (quantized unless `quantized=False`, then all F32)."""
    config = model.config
    writer = GGUFWriter(str(path), family)
    _write_metadata(writer, family, config)
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        gguf_name = gguf_name_of(family, hf_name)
        values = _convert(family, gguf_name, tensor.numpy().astype(np.float32), config)
        _add_tensor(writer, gguf_name, values, quantized)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def gguf_name_of(family: str, hf_name: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if hf_name in top:
        return top[hf_name]
    if hf_name == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf_name.split(".", 3)
    module, suffix = rest.rsplit(".", 1)
    table = {**_HF_TO_GGUF_BLOCK, **_FAMILY_BLOCK[family]}
    return f"blk.{layer}.{table[module]}.{suffix}"


def _convert(family: str, gguf_name: str, values: np.ndarray, config: Any) -> np.ndarray:
    if family == "gemma3" and gguf_name.endswith("norm.weight"):
        return values + np.float32(1.0)
    if family == "llama" and ".attn_q." in gguf_name:
        return _permute(values, config.num_attention_heads)
    if family == "llama" and ".attn_k." in gguf_name:
        return _permute(values, config.num_key_value_heads)
    return values


def _permute(values: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's permutation: per head, rows [first half | second half] become interleaved pairs."""
    half = values.shape[0] // n_heads // 2
    heads = values.reshape(n_heads, 2, half, *values.shape[1:])
    return np.ascontiguousarray(heads.swapaxes(1, 2)).reshape(values.shape)


def _add_tensor(writer: GGUFWriter, name: str, values: np.ndarray, quantized: bool) -> None:
    qtype = _WEIGHT_TYPES.get(name.split(".")[-2]) if quantized and values.ndim == 2 else None
    if qtype is None:
        writer.add_tensor(name, values)
    elif qtype == GGMLQuantizationType.F16:
        writer.add_tensor(name, values.astype(np.float16))
    else:
        data = quantize(values, qtype)
        writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)


def _write_metadata(writer: GGUFWriter, family: str, config: Any) -> None:
    writer.add_name(f"tiny {family}")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if family == "llama":
        writer.add_rope_dimension_count(head_dim)
        writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    else:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_rope_freq_base(config.rope_parameters["full_attention"]["rope_theta"])
        writer.add_sliding_window(config.sliding_window)
    _write_vocab(writer)


def _write_vocab(writer: GGUFWriter) -> None:
    """A SentencePiece-style vocabulary: specials, the 256 byte tokens, then a few word pieces."""
    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    pieces = [f"▁w{i}" for i in range(VOCAB_SIZE - len(specials) - 256)]
    tokens = specials + [f"<0x{b:02X}>" for b in range(256)] + pieces
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * len(specials) + [0.0] * 256 + [-float(i) for i in range(len(pieces))])
    writer.add_token_types([2, 3, 3, 3] + [6] * 256 + [1] * len(pieces))
    writer.add_bos_token_id(BOS)
    writer.add_eos_token_id(EOS)
    writer.add_unk_token_id(UNK)
    writer.add_pad_token_id(PAD)

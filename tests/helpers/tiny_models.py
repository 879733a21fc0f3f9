"""Tiny random checkpoints of each family, written as real HF directories (config, safetensors, tokenizer)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Edge inference serves language models close to their users.",
    "Paged attention stores keys and values in fixed-size blocks.",
    "Continuous batching lets new requests join running ones at every step.",
    "Hello, world! Ünïcödé and emoji 🙂 and 漢字 too.",
] * 4

VOCAB_SIZE = 384


def build_tokenizer(path: Path) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on a fixed corpus: deterministic, offline, any text encodable."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - 3,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.save_pretrained(path)
    return fast


_BASE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

FAMILIES: dict[str, dict[str, Any]] = {
    "llama": dict(
        model_type="llama", architectures=["LlamaForCausalLM"], tie_word_embeddings=False, rope_theta=10000.0
    ),
    "qwen3": dict(
        model_type="qwen3",
        architectures=["Qwen3ForCausalLM"],
        head_dim=32,
        tie_word_embeddings=True,
        rope_theta=1000000.0,
    ),
    "gemma3": dict(
        model_type="gemma3_text",
        architectures=["Gemma3ForCausalLM"],
        head_dim=32,
        num_hidden_layers=3,
        sliding_window=8,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        query_pre_attn_scalar=24,
        rope_theta=1000000.0,
        rope_local_base_freq=10000.0,
        hidden_activation="gelu_pytorch_tanh",
        tie_word_embeddings=True,
    ),
}


def make_tiny(family: str, path: Path, seed: int = 0, **overrides: Any) -> Path:
    """Write a random tiny `family` checkpoint (fp32 safetensors + tokenizer) into `path`."""
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(path)
    fields = {**_BASE, "vocab_size": len(tokenizer), **FAMILIES[family], **overrides}
    model_type = fields.pop("model_type")
    config = AutoConfig.for_model(model_type, **fields)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize_norms(model)
    model.save_pretrained(path, safe_serialization=True)
    return path


def make_tiny_llama(path: Path) -> Path:
    return make_tiny("llama", path)


def _randomize_norms(model: torch.nn.Module) -> None:
    """HF initialises norm weights to constants; random ones make the tests sensitive to norm mistakes."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0 if "gemma" in type(model).__name__.lower() else 1.0, 0.1)

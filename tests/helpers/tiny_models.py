"""Tiny random checkpoints of each family, written as real HF directories (config, safetensors, tokenizer)."""

from __future__ import annotations

from collections.abc import Callable
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
    # MoE families: 3 layers, the first dense; 8 experts, top-2.
    "qwen3_moe": dict(
        model_type="qwen3_moe",
        architectures=["Qwen3MoeForCausalLM"],
        num_hidden_layers=3,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        mlp_only_layers=[0],
        norm_topk_prob=True,
        tie_word_embeddings=False,
        rope_theta=1000000.0,
    ),
    "glm4_moe": dict(
        model_type="glm4_moe",
        architectures=["Glm4MoeForCausalLM"],
        num_hidden_layers=3,
        head_dim=32,
        partial_rotary_factor=0.5,
        use_qk_norm=True,
        attention_bias=True,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        n_shared_experts=1,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=1.5,
        first_k_dense_replace=1,
        tie_word_embeddings=False,
    ),
    # MLA with q_lora_rank, interleaved rope and YaRN (mscale != mscale_all_dim changes the softmax scale).
    "deepseek_v3": dict(
        model_type="deepseek_v3",
        architectures=["DeepseekV3ForCausalLM"],
        num_hidden_layers=3,
        num_key_value_heads=4,  # MLA has no KV heads; DeepSeek configs set this to num_attention_heads
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=24,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        n_shared_experts=1,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        first_k_dense_replace=1,
        rope_interleave=True,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=10000.0,
            factor=8.0,
            original_max_position_embeddings=64,
            mscale=1.0,
            mscale_all_dim=0.8,
            beta_fast=32,
            beta_slow=1,
        ),
        tie_word_embeddings=False,
    ),
    # MLA without q_lora_rank (a full-rank q_proj), rotate-half rope, attention biases.
    "deepseek_v3_full_q": dict(
        model_type="deepseek_v3",
        architectures=["DeepseekV3ForCausalLM"],
        num_hidden_layers=3,
        num_key_value_heads=4,  # MLA has no KV heads; DeepSeek configs set this to num_attention_heads
        q_lora_rank=None,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        n_shared_experts=2,
        n_group=1,
        topk_group=1,
        norm_topk_prob=False,
        routed_scaling_factor=1.0,
        first_k_dense_replace=1,
        rope_interleave=False,
        attention_bias=True,
        tie_word_embeddings=False,
    ),
}
# The mixture-of-experts families, Kimi's MLA layout among them.
MOE_FAMILIES = ("qwen3_moe", "glm4_moe", "deepseek_v3")


def make_tiny(
    family: str,
    path: Path,
    seed: int = 0,
    tokenizer_builder: Callable[[Path], PreTrainedTokenizerFast] = build_tokenizer,
    **overrides: Any,
) -> Path:
    """Write a random tiny `family` checkpoint (fp32 safetensors + tokenizer) into `path`."""
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = tokenizer_builder(path)
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


def make_draft(target: Path, path: Path, keep: list[int], noise: float, **overrides: Any) -> Path:
    """A draft model for `target` (a checkpoint of make_tiny): its layers `keep` only, every weight perturbed
    by `noise` times its own scale, its config changed by `overrides`; the target's tokenizer files. It
    agrees with the target often but not always, as a small model of the same family does."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    path.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (target / name).exists():
            shutil.copy(target / name, path / name)
    config = json.loads((target / "config.json").read_text())
    config.update(num_hidden_layers=len(keep), **overrides)
    if "layer_types" in config and "layer_types" not in overrides:
        config["layer_types"] = [config["layer_types"][i] for i in keep]
    (path / "config.json").write_text(json.dumps(config))
    generator = torch.Generator().manual_seed(1)
    renumber = {f"layers.{old}.": f"layers.{new}." for new, old in enumerate(keep)}
    tensors = {}
    for name, t in load_file(target / "model.safetensors").items():
        if ".layers." in name:
            layer = name.split(".layers.")[1].split(".")[0]
            if int(layer) not in keep:
                continue
            name = name.replace(f"layers.{layer}.", renumber[f"layers.{layer}."])
        jitter = noise * t.std() * torch.randn(t.shape, generator=generator) if t.numel() > 1 else 0
        tensors[name] = t + jitter
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path

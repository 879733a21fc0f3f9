"""Tiny tokenizer checkpoints written for the tests: a byte-level BPE directory and a SentencePiece GGUF."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from gguf import GGUFWriter
from safetensors.numpy import save_file
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Serving language models close to their users.",
    "Unicode: naïve café, 漢字かな, emoji 🙂🚀, and more.",
] * 5
GGUF_WORDS = ["hello", "world", "the", "model", "edge"]


def write_bpe_checkpoint(path: Path, chat_template: str | None = None) -> Path:
    """config.json + a placeholder weight + a byte-level BPE tokenizer trained on CORPUS (with `<eot>`)."""
    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<pad>", "<s>", "</s>", "<eot>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    raw.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.add_bos_token = True
    fast.chat_template = chat_template
    path.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(path)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "eos_token_id": 2}
    (path / "config.json").write_text(json.dumps(config))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 3]}))
    save_file({"placeholder": np.zeros(1, dtype=np.float32)}, str(path / "model.safetensors"))
    return path


def write_spm_gguf(path: Path, arch: str = "llama") -> Path:
    """A GGUF whose vocabulary is SentencePiece-style: control tokens, 256 byte-fallback tokens, single
    characters, a few whole words (with the ▁ space marker) and user-defined runs of spaces and newlines.
    `llama` reads it with a dummy space prefix (as Llama 2's), `gemma3` without (as Gemma's)."""
    chars = sorted(set("".join(GGUF_WORDS)) | set("abcdefghijklmnopqrstuvwxyz.,!?"))
    words = [f"▁{word}" for word in GGUF_WORDS]
    tokens = [
        "<unk>",
        "<s>",
        "</s>",
        "<end_of_turn>",
        *[f"<0x{b:02X}>" for b in range(256)],
        "▁",
        *chars,
        *words,
        "  ",
        "\n\n",
    ]
    writer = GGUFWriter(str(path), arch)
    shape = {"context_length": 64, "embedding_length": 32, "block_count": 1, "feed_forward_length": 64}
    for key, value in {**shape, "attention.head_count": 2}.items():
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * 260 + [-float(i) for i in range(len(tokens) - 260)])
    writer.add_token_types([2, 3, 3, 3] + [6] * 256 + [1] * (len(tokens) - 262) + [4, 4])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_space_prefix(arch != "gemma3")
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path

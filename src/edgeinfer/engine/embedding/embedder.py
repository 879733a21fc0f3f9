"""Embedder: a sentence-transformers directory as tokenizer + packed encoder + pooling, run synchronously."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from edgeinfer.engine import kernels
from edgeinfer.engine.embedding.config import EmbeddingConfig
from edgeinfer.engine.embedding.encoder_tokenizer import load_encoder_tokenizer
from edgeinfer.engine.embedding.sentence_config import SentenceConfig, read_sentence_config
from edgeinfer.engine.loading import resolve_dtype
from edgeinfer.engine.model.bert import BLOCKED_ROW_MULTIPLE, PackedBatch, choose_attention
from edgeinfer.engine.model.encoders import build_encoder, is_encoder_config
from edgeinfer.engine.model.loader import CheckpointError, open_checkpoint
from edgeinfer.engine.model.loader.safetensors_checkpoint import SafetensorsCheckpoint
from edgeinfer.engine.model.pooling import pool
from edgeinfer.engine.model.skip_init import SkipInit

log = logging.getLogger(__name__)


class Embedder:
    """Token ids in, one fp32 vector per input out. Inputs of any length mix in one forward pass."""

    def __init__(self, config: EmbeddingConfig) -> None:
        self.config = config
        self.device = torch.device(config.device)
        ckpt = open_checkpoint(config.model)
        if not isinstance(ckpt, SafetensorsCheckpoint) or not is_encoder_config(ckpt.config):
            raise CheckpointError(
                f"{config.model}: not an embedding model (a BERT sentence-transformers dir)"
            )
        self.path = ckpt.path
        self.sentence: SentenceConfig = read_sentence_config(ckpt.path, ckpt.config)
        self.tokenizer = load_encoder_tokenizer(ckpt.path, self.sentence.max_seq_length)
        self.dtype = encoder_dtype(config.dtype, self.device)
        head_dim = ckpt.config["hidden_size"] // ckpt.config["num_attention_heads"]
        self.attention = choose_attention(config.attention, self.device, head_dim)
        with torch.device(self.device), SkipInit():  # load_weights fills every parameter or refuses
            model = build_encoder(ckpt.config, self.attention).to(self.dtype)
        model.load_weights(ckpt.iter_tensors(self.dtype))
        self.model = model.eval().requires_grad_(False)
        self.blocked_bytes = 0
        if config.blocked_weights and blocked_weights_run(self.device, self.dtype):
            self.blocked_bytes = model.block_weights(config.max_pass_tokens)
        self.dim: int = model.args.hidden_size
        self.vocab_size: int = model.args.vocab_size
        self.max_seq_length: int = self.sentence.max_seq_length
        log.info(
            "embedding model ready: %s, %s, %s attention, dim %d, %s pooling%s, max %d tokens",
            config.model,
            self.dtype,
            self.attention,
            self.dim,
            self.sentence.pooling,
            " + normalize" if self.sentence.normalize else "",
            self.max_seq_length,
        )

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids with the special tokens, truncated to the model's maximum length (as
        sentence-transformers truncates)."""
        return self.tokenizer.tokenize(texts)

    @torch.inference_mode()
    def embed(self, inputs: Sequence[Sequence[int]]) -> torch.Tensor:
        """[n, dim] fp32 vectors, in the order of `inputs` (each non-empty, at most max_seq_length)."""
        if not inputs:
            return torch.empty(0, self.dim)
        # Sorted by length so that equal lengths are adjacent (grouped attention) and each pass holds
        # similar lengths; unsorted at the end.
        order = sorted(range(len(inputs)), key=lambda i: len(inputs[i]))
        parts = [
            self._embed_sorted([inputs[i] for i in chunk])
            for chunk in split_by_tokens(order, [len(x) for x in inputs], self.config.max_pass_tokens)
        ]
        vectors = torch.cat(parts)
        out = torch.empty_like(vectors)
        out[torch.tensor(order, device=vectors.device)] = vectors
        return out.cpu()

    def _embed_sorted(self, sorted_inputs: list[Sequence[int]]) -> torch.Tensor:
        rows = BLOCKED_ROW_MULTIPLE if self.blocked_bytes else 1
        batch = PackedBatch.build(sorted_inputs, self.device, rows)
        hidden = self.model(batch)[: batch.tokens]
        lengths = batch.lengths[: batch.sequences]
        return pool(hidden, lengths, self.sentence.pooling, self.sentence.normalize)

    def memory_bytes(self) -> int:
        params = sum(p.numel() * p.element_size() for p in self.model.parameters())
        return params + self.blocked_bytes


def split_by_tokens(order: Sequence[int], lengths: Sequence[int], cap: int) -> list[list[int]]:
    """Consecutive runs of `order` holding at most `cap` tokens each (an input longer than `cap` alone)."""
    chunks: list[list[int]] = []
    tokens = cap + 1
    for i in order:
        if tokens + lengths[i] > cap:
            chunks.append([])
            tokens = 0
        chunks[-1].append(i)
        tokens += lengths[i]
    return chunks


def blocked_weights_run(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether oneDNN can hold weights of `dtype` in its blocked layout here: a CPU build with oneDNN, and
    for bf16 a CPU it has bf16 code for (AVX-512 BW/VL/DQ or AVX-NE-CONVERT; an AVX2-only CPU has none,
    and an asked-for bf16 encoder runs torch's plain linears there)."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported()


def encoder_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto`: bf16 on a GPU or a CPU with bf16 matmuls in hardware, else fp32. An encoder is all
    matmuls, and emulated bf16 is several times slower than fp32 (no memory-bound decode to win back,
    unlike generation, whose bf16 GEMV kernels halve the bytes read on any AVX2 CPU)."""
    if name == "auto" and device.type == "cpu" and not kernels.cpu_has_bf16_matmul():
        return torch.float32
    return resolve_dtype(name, device)

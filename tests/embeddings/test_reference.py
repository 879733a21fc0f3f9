"""Our encoder against sentence-transformers' `encode` on the same all-MiniLM-L6-v2 directory."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers.embeddings import varied_texts

from edgeinfer.engine.embedding.config import EmbeddingConfig
from edgeinfer.engine.embedding.embedder import Embedder, split_by_tokens
from edgeinfer.engine.model import bert


@pytest.fixture(scope="module")
def reference(st_model) -> torch.Tensor:
    return torch.tensor(st_model.encode(varied_texts(), batch_size=64))


def test_texts_cover_the_maximum_length(embedder_fp32: Embedder, st_model) -> None:
    texts = varied_texts()
    full = [len(ids) for ids in st_model.tokenizer(texts)["input_ids"]]
    assert len(texts) >= 50
    assert sum(n > embedder_fp32.max_seq_length for n in full) >= 3
    assert max(map(len, embedder_fp32.tokenize(texts))) == embedder_fp32.max_seq_length == 256


def test_fp32_matches_sentence_transformers(embedder_fp32: Embedder, reference: torch.Tensor) -> None:
    ours = embedder_fp32.embed(embedder_fp32.tokenize(varied_texts()))
    cosine = F.cosine_similarity(ours, reference)
    assert cosine.min().item() >= 0.9999, cosine.argmin()
    assert torch.allclose(ours.norm(dim=-1), torch.ones(len(ours)), atol=1e-5)  # Normalize module


def test_bf16_matches_sentence_transformers(minilm: Path, reference: torch.Tensor) -> None:
    embedder = Embedder(EmbeddingConfig(model=str(minilm), dtype="bfloat16"))
    assert embedder.model.word_embeddings.weight.dtype == torch.bfloat16
    ours = embedder.embed(embedder.tokenize(varied_texts()))
    assert F.cosine_similarity(ours, reference).min().item() >= 0.999


def test_mixed_length_batch_equals_each_text_alone(embedder_fp32: Embedder) -> None:
    texts = varied_texts()[::3]
    ids = embedder_fp32.tokenize(texts)
    assert len({len(x) for x in ids}) > 5  # lengths really are mixed
    together = embedder_fp32.embed(ids)
    alone = torch.cat([embedder_fp32.embed([x]) for x in ids])
    torch.testing.assert_close(together, alone, atol=2e-6, rtol=0)


def test_masked_attention_equals_grouped(
    minilm: Path, embedder_fp32: Embedder, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bert, "MASK_CHUNK_TOKENS", 300)  # several chunks, and a 256-token one alone
    masked = Embedder(EmbeddingConfig(model=str(minilm), dtype="float32", attention="masked"))
    ids = embedder_fp32.tokenize(varied_texts()[-25:])
    assert len(bert.block_diagonal_chunks(sorted(map(len, ids)), torch.device("cpu"))) >= 3
    torch.testing.assert_close(masked.embed(ids), embedder_fp32.embed(ids), atol=2e-6, rtol=0)


def test_passes_capped_by_tokens_equal_one_pass(minilm: Path, embedder_fp32: Embedder) -> None:
    capped = Embedder(EmbeddingConfig(model=str(minilm), dtype="float32", max_pass_tokens=300))
    ids = embedder_fp32.tokenize(varied_texts()[-25:])
    chunks = split_by_tokens(range(len(ids)), [len(x) for x in ids], 300)
    assert len(chunks) >= 3 and all(sum(len(ids[i]) for i in c) <= 300 or len(c) == 1 for c in chunks)
    uncapped = Embedder(EmbeddingConfig(model=str(minilm), dtype="float32", max_pass_tokens=1 << 20))
    torch.testing.assert_close(capped.embed(ids), uncapped.embed(ids), atol=2e-6, rtol=0)

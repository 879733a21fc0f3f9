"""Our encoder against sentence-transformers' `encode` on the same all-MiniLM-L6-v2 directory."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers.embeddings import varied_texts

from edgeinfer.engine import kernels
from edgeinfer.engine.embedding.config import EmbeddingConfig
from edgeinfer.engine.embedding.embedder import Embedder, blocked_weights_run, split_by_tokens
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
    masked, grouped = (
        Embedder(EmbeddingConfig(model=str(minilm), dtype="float32", attention=mode))
        for mode in ("masked", "grouped")
    )
    ids = embedder_fp32.tokenize(varied_texts()[-25:])
    assert len(bert.block_diagonal_chunks(sorted(map(len, ids)), torch.device("cpu"))) >= 3
    torch.testing.assert_close(masked.embed(ids), grouped.embed(ids), atol=2e-6, rtol=0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_packed_attention_equals_grouped(minilm: Path, dtype: str) -> None:
    try:
        kernels.load()
    except kernels.KernelBuildError as e:
        pytest.skip(f"the CPU kernels cannot be built here: {e}")
    packed, grouped = (
        Embedder(EmbeddingConfig(model=str(minilm), dtype=dtype, attention=mode))
        for mode in ("packed", "grouped")
    )
    assert (packed.attention, grouped.attention) == ("packed", "grouped")
    ids = packed.tokenize(varied_texts())
    a, b = packed.embed(ids), grouped.embed(ids)
    if dtype == "float32":
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    else:  # bf16 activations between the layers: both round, in different places
        assert F.cosine_similarity(a, b).min().item() >= 0.999


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_blocked_weights_equal_plain_linears(minilm: Path, dtype: str) -> None:
    if not blocked_weights_run(torch.device("cpu"), getattr(torch, dtype)):
        pytest.skip(f"oneDNN holds no {dtype} weights blocked on this CPU (or torch has no oneDNN)")
    blocked, plain = (
        Embedder(EmbeddingConfig(model=str(minilm), dtype=dtype, blocked_weights=on)) for on in (True, False)
    )
    assert blocked.model.layers[0].up.blocked is not None and plain.model.layers[0].up.blocked is None
    assert blocked.memory_bytes() > plain.memory_bytes()  # the copies are counted against the pool
    ids = blocked.tokenize(varied_texts())
    a, b = blocked.embed(ids), plain.embed(ids)
    if dtype == "float32":
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    else:  # the fused GELU reads the fp32 sum, the plain one its bf16 rounding
        assert F.cosine_similarity(a, b).min().item() >= 0.999


def test_auto_attention_is_packed_where_the_kernel_vectorises(embedder_fp32: Embedder) -> None:
    try:
        kernels.load()
        isa = torch.ops.edgeinfer_cpu.isa()
    except kernels.KernelBuildError:
        isa = "scalar"
    # the packed kernel's vector variant is AVX-512's; an AVX2 CPU runs it as plain loops
    vectorised = isa in kernels.ISA_LEVELS[kernels.ISA_LEVELS.index("avx512") :]
    assert embedder_fp32.attention == ("packed" if vectorised else "grouped")  # MiniLM: head dim 32


def test_passes_capped_by_tokens_equal_one_pass(minilm: Path, embedder_fp32: Embedder) -> None:
    capped = Embedder(EmbeddingConfig(model=str(minilm), dtype="float32", max_pass_tokens=300))
    ids = embedder_fp32.tokenize(varied_texts()[-25:])
    chunks = split_by_tokens(range(len(ids)), [len(x) for x in ids], 300)
    assert len(chunks) >= 3 and all(sum(len(ids[i]) for i in c) <= 300 or len(c) == 1 for c in chunks)
    uncapped = Embedder(EmbeddingConfig(model=str(minilm), dtype="float32", max_pass_tokens=1 << 20))
    torch.testing.assert_close(capped.embed(ids), uncapped.embed(ids), atol=2e-6, rtol=0)

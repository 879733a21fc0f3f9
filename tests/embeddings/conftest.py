"""The real all-MiniLM-L6-v2 and sentence-transformers' own encoding of it, built once per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from helpers.embeddings import minilm_dir

from edgeinfer.engine.embedding.config import EmbeddingConfig
from edgeinfer.engine.embedding.embedder import Embedder


@pytest.fixture(scope="session")
def minilm() -> Path:
    return minilm_dir()


@pytest.fixture(scope="session")
def st_model(minilm: Path):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local directory: nothing to fetch
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(minilm), device="cpu")


@pytest.fixture(scope="session")
def embedder_fp32(minilm: Path) -> Embedder:
    return Embedder(EmbeddingConfig(model=str(minilm), dtype="float32"))

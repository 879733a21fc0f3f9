"""`edgeinfer embed`: embed texts with an embedding model and print the vectors' shape and first values."""

from __future__ import annotations

import argparse

from edgeinfer.engine.config import DEFAULT_EMBEDDING_MODEL

_SHOWN = 8


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=DEFAULT_EMBEDDING_MODEL,
        help="sentence-transformers directory or a known name "
        f"(default: {DEFAULT_EMBEDDING_MODEL}, installed and cached on first use)",
    )
    p.add_argument("--text", action="append", required=True, help="text to embed (repeatable)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])


def run(args: argparse.Namespace) -> int:
    if any(not text for text in args.text):
        raise ValueError("--text must not be empty")
    from edgeinfer.engine.embedding import is_embedding_model

    # Checked before torch loads, so a wrong --model fails at once.
    if not is_embedding_model(args.model):
        raise ValueError(
            f"{args.model}: not an embedding model (a BERT sentence-transformers directory, "
            f"or {DEFAULT_EMBEDDING_MODEL})"
        )
    from edgeinfer.engine.embedding.config import EmbeddingConfig
    from edgeinfer.engine.embedding.embedder import Embedder

    embedder = Embedder(EmbeddingConfig(model=args.model, dtype=args.dtype))
    vectors = embedder.embed(embedder.tokenize(args.text))
    print(f"shape: {list(vectors.shape)}")
    for text, row in zip(args.text, vectors.tolist(), strict=True):
        shown = ", ".join(f"{v:.6f}" for v in row[:_SHOWN])
        print(f"{text[:40]!r}: [{shown}, ...]")
    return 0

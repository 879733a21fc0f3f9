"""Embedding models: encoders read from sentence-transformers directories, batched by tokens."""

from __future__ import annotations

from pathlib import Path

from edgeinfer.engine.model.loader.default_embedding import is_default_embedding_model


def is_embedding_model(target: str) -> bool:
    """Whether `target` (a directory or a known name) is an embedding model, without loading it:
    the default embedding model's names, or a directory whose config.json names an encoder."""
    if is_default_embedding_model(target):
        return True
    path = Path(target).expanduser()
    if not (path / "config.json").is_file():
        return False
    from edgeinfer.engine.model.encoders import is_encoder_config
    from edgeinfer.engine.model.loader.safetensors_checkpoint import read_config_json

    try:
        return is_encoder_config(read_config_json(path))
    except ValueError:
        return False

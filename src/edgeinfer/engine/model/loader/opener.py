"""`open_checkpoint`: one entry point for every checkpoint format and for the default model's names."""

from __future__ import annotations

from pathlib import Path

from edgeinfer.engine.model.loader.base import Checkpoint
from edgeinfer.engine.model.loader.default_embedding import (
    DEFAULT_EMBEDDING_ALIASES,
    is_default_embedding_model,
    resolve_default_embedding_model,
)
from edgeinfer.engine.model.loader.default_model import (
    DEFAULT_MODEL_ALIASES,
    is_default_model,
    resolve_default_model,
)
from edgeinfer.engine.model.loader.eiz_checkpoint import EizCheckpoint, is_eiz_directory
from edgeinfer.engine.model.loader.errors import CheckpointError
from edgeinfer.engine.model.loader.gguf_checkpoint import GGUFCheckpoint
from edgeinfer.engine.model.loader.safetensors_checkpoint import SafetensorsCheckpoint


def is_known_model(name: str) -> bool:
    """A default model's name (the generation or the embedding model), as `open_checkpoint` takes it."""
    return is_default_model(name) or is_default_embedding_model(name)


def checkpoint_location(path_or_name: str | Path) -> Path:
    """Where `open_checkpoint` would read from, without reading any header: a default model's name
    resolves to its file (assembled into the model cache if needed), anything else is taken as a path.
    Sizing or fingerprinting a model needs only this; parsing a GGUF header with a big vocabulary is slow."""
    if isinstance(path_or_name, str) and is_default_model(path_or_name):
        return resolve_default_model(path_or_name)
    if isinstance(path_or_name, str) and is_default_embedding_model(path_or_name):
        return resolve_default_embedding_model()
    return Path(path_or_name).expanduser()


def open_checkpoint(path_or_name: str | Path) -> Checkpoint:
    """Open an HF directory (config.json + *.safetensors or model.eiz), a `.gguf` file, or a default model by
    name (the generation model, or the embedding model).

    Only headers are read here; tensors are read when `iter_tensors` is iterated. Every problem (missing path,
    no weights, unsupported architecture, truncated or corrupt file) raises `CheckpointError` naming the file.
    """
    if isinstance(path_or_name, str) and is_default_model(path_or_name):
        return GGUFCheckpoint(resolve_default_model(path_or_name))
    if isinstance(path_or_name, str) and is_default_embedding_model(path_or_name):
        return SafetensorsCheckpoint(resolve_default_embedding_model())
    path = Path(path_or_name).expanduser()
    if path.is_dir():
        return EizCheckpoint(path) if is_eiz_directory(path) else SafetensorsCheckpoint(path)
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise CheckpointError(f"{path}: not a checkpoint (expected a directory or a .gguf file)")
        return GGUFCheckpoint(path)
    if path.exists():
        raise CheckpointError(f"{path}: not a regular file or directory")
    names = ", ".join(sorted(DEFAULT_MODEL_ALIASES | DEFAULT_EMBEDDING_ALIASES))
    raise CheckpointError(f"{path}: no such file or directory (and not a known model name: {names})")

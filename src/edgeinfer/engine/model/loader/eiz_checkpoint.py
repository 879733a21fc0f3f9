"""`.eiz` checkpoint directories (`edgeinfer compress`): config.json, tokenizer files and `model.eiz`, whose
bf16 tensors are exponent-coded losslessly; they are decoded by the vectorised codec as they are read."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from edgeinfer.engine.model.loader.base import Checkpoint, cast_floating, with_progress
from edgeinfer.engine.model.loader.codec import CodecError, open_compressed
from edgeinfer.engine.model.loader.codec.files import COMPRESSED_FILE
from edgeinfer.engine.model.loader.errors import CheckpointError, one_line
from edgeinfer.engine.model.loader.safetensors_checkpoint import read_config_json


def is_eiz_directory(path: Path) -> bool:
    return (path / COMPRESSED_FILE).is_file()


class EizCheckpoint(Checkpoint):
    """A directory holding `model.eiz`; opening checks its index (and that every tensor lies inside the
    file), reading a tensor checks its sections' checksums and the decoded bytes' sha256."""

    format = "eiz"

    def __init__(self, directory: Path) -> None:
        config = read_config_json(directory)
        try:
            self._file = open_compressed(directory / COMPRESSED_FILE)
        except (CodecError, OSError, ValueError) as exc:
            raise CheckpointError(f"{directory / COMPRESSED_FILE}: unreadable ({one_line(exc)})") from exc
        super().__init__(directory, config, tokenizer_dir=directory)

    def tensor_names(self) -> list[str]:
        return self._file.names

    def iter_tensors(self, dtype: torch.dtype = torch.float32) -> Iterator[tuple[str, torch.Tensor]]:
        items = with_progress(self._decoded(dtype), len(self._file), desc=f"Decoding {self.path.name}")
        yield from items

    def _decoded(self, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        try:
            for name, tensor in self._file:
                yield name, cast_floating(tensor, dtype)
        except CodecError as exc:
            raise CheckpointError(f"{self._file.path}: {one_line(exc)}") from exc

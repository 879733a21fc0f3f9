"""GGUF files: an HF-shaped config from the metadata, tensors dequantized at load and renamed to HF names."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from edgeinfer.engine.model.loader.base import Checkpoint, cast_floating, with_progress
from edgeinfer.engine.model.loader.errors import CheckpointError, one_line
from edgeinfer.engine.model.loader.gguf_arch import architecture_for
from edgeinfer.engine.model.loader.gguf_file import GGUFFile, TensorInfo
from edgeinfer.engine.model.loader.gguf_meta import ArchMetadata


class GGUFCheckpoint(Checkpoint):
    """One `.gguf` file. Weights are dequantized to float32, restored to the HF convention, then cast.

    The tokenizer is built from the file's metadata; `tokenizer_dir` is where that build is cached
    (`<file>.tokenizer/` next to the file).
    """

    format = "gguf"

    def __init__(self, path: Path) -> None:
        self._file = GGUFFile(path)
        meta = ArchMetadata(path, self._file.architecture, self._file.metadata)
        self._arch = architecture_for(meta)
        settings = {info.name: self._file.read(info) for info in self._file.tensors if self._is_setting(info)}
        weights = [info for info in self._file.tensors if not self._is_setting(info)]
        self._tensors = [(self._hf_name(info), info) for info in weights]
        config = self._arch.config(meta, {info.name for info in self._file.tensors}, settings)
        super().__init__(path, config, tokenizer_dir=path.with_name(path.name + ".tokenizer"))

    @property
    def gguf_path(self) -> Path:
        return self.path

    @property
    def metadata(self) -> dict[str, Any]:
        """The raw GGUF metadata (string arrays such as the vocabulary appear only as their length)."""
        return self._file.metadata

    def tensor_names(self) -> list[str]:
        return [name for name, _ in self._tensors]

    def gguf_tensor_types(self) -> dict[str, str]:
        """HF name → the GGML storage type in the file (Q4_K, Q8_0, F32, ...), e.g. for reporting."""
        return {name: info.qtype.name for name, info in self._tensors}

    def iter_tensors(self, dtype: torch.dtype = torch.float32) -> Iterator[tuple[str, torch.Tensor]]:
        items = ((name, self._read(info, dtype)) for name, info in self._tensors)
        yield from with_progress(items, len(self._tensors), desc=f"Dequantizing {self.path.name}")

    def _read(self, info: TensorInfo, dtype: torch.dtype) -> torch.Tensor:
        try:
            values = self._file.read(info)
        except (ValueError, OSError) as exc:
            raise CheckpointError(f"{self.path}: cannot read tensor {info.name} ({one_line(exc)})") from exc
        values = self._arch.restore(info.name, values, self.config)
        return cast_floating(torch.from_numpy(values), dtype)

    def _is_setting(self, info: TensorInfo) -> bool:
        return info.name in self._arch.config_tensors

    def _hf_name(self, info: TensorInfo) -> str:
        name = self._arch.hf_name(info.name)
        if name is None:
            # Refuse rather than skip: an unknown tensor (say, a fused QKV) would change the model's math.
            model = self._arch.hf_architecture
            raise CheckpointError(
                f"{self._file.path}: tensor {info.name} has no known place in a {model} model"
            )
        return name

"""What every checkpoint format offers the model code: an HF-shaped config and HF-named tensors."""

from __future__ import annotations

import sys
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import torch
from tqdm import tqdm

# A progress bar only pays for itself when loading takes a noticeable while.
_PROGRESS_MIN_TENSORS = 50

T = TypeVar("T")


class Checkpoint(ABC):
    """An opened checkpoint.

    `path`: the file or directory it was opened from. `config`: a dict shaped like HF's config.json (it
    always has `architectures`). `tokenizer_dir`: where the tokenizer files live (or, for a GGUF, where a
    tokenizer built from its metadata is cached). `gguf_path`: the GGUF file, or None for other formats.
    """

    format: ClassVar[str]

    def __init__(self, path: Path, config: dict[str, Any], tokenizer_dir: Path) -> None:
        self.path = path
        self.config = config
        self.tokenizer_dir = tokenizer_dir

    @property
    def gguf_path(self) -> Path | None:
        return None

    @abstractmethod
    def tensor_names(self) -> list[str]:
        """HF names of the tensors `iter_tensors` yields, in the same order."""

    @abstractmethod
    def iter_tensors(self, dtype: torch.dtype = torch.float32) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield `(hf_name, tensor)` one at a time, floating-point tensors cast to `dtype`.

        Tensors are read lazily so that peak memory stays near one tensor on top of the model being filled.
        Integer tensors (already-quantized weights, index buffers) keep their dtype.
        """

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.path)!r}, architectures={self.config.get('architectures')})"


def with_progress(items: Iterable[T], total: int, desc: str) -> Iterable[T]:
    """Wrap `items` in a tqdm bar on stderr when there are enough of them to be worth watching."""
    if total <= _PROGRESS_MIN_TENSORS:
        return items
    return tqdm(items, total=total, desc=desc, unit="tensor", file=sys.stderr, leave=False)


def cast_floating(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """Cast floating-point tensors to `dtype`; leave integer and bool tensors as they are.
    `dtype=None` keeps every tensor as stored (quantized checkpoints: float8 payloads, fp32 scales)."""
    if dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype:
        return tensor.to(dtype)
    return tensor

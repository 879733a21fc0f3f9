"""Write named tensors to a `.eiz` file and read them back (`edgeinfer compress`, cold-start loading)."""

from __future__ import annotations

import logging
import time
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from edgeinfer.engine.model.loader.codec.container import (
    CodecError,
    DataWriter,
    decode_entry,
    encode_entry,
    read_index,
    write_container,
)

log = logging.getLogger(__name__)

COMPRESSED_FILE = "model.eiz"


@dataclass
class CompressStats:
    """Sizes of one compressed file."""

    tensors: int
    coded: int  # tensors stored with the exponent code (the rest raw)
    original_bytes: int
    stored_bytes: int
    seconds: float = 0.0

    @property
    def ratio(self) -> float:
        return self.stored_bytes / self.original_bytes if self.original_bytes else 1.0

    @property
    def bytes_saved(self) -> int:
        return self.original_bytes - self.stored_bytes

    def summary(self) -> str:
        return (
            f"{self.tensors} tensors ({self.coded} exponent-coded): {_mib(self.original_bytes)} -> "
            f"{_mib(self.stored_bytes)} ({self.ratio:.1%}), saved {_mib(self.bytes_saved)} "
            f"in {self.seconds:.1f} s"
        )


def compress_tensors(
    tensors: Iterable[tuple[str, torch.Tensor]], path: Path, metadata: dict[str, Any] | None = None
) -> CompressStats:
    """Write named tensors to one `.eiz` file."""
    start = time.perf_counter()
    seen: set[str] = set()

    def write(out: DataWriter) -> list[dict[str, Any]]:
        entries = []
        for name, t in tensors:
            if name in seen:
                raise CodecError(f"duplicate tensor name {name!r}")
            seen.add(name)
            entries.append(encode_entry(out, name, t))
        return entries

    size = write_container(path, write, metadata)
    stats = CompressedFile(path).stats()
    stats.stored_bytes, stats.seconds = size, time.perf_counter() - start
    return stats


class CompressedFile:
    """A `.eiz` file opened for reading; iterating yields `(name, tensor)` and logs the bytes saved.

    Opening checks the header, the index checksum and that every tensor lies inside the file; reading a
    tensor checks its sections' crc32 and (with `verify`) the sha256 of the decoded bytes.
    """

    def __init__(self, path: Path | str, verify: bool = True) -> None:
        path = Path(path)
        self.path = path / COMPRESSED_FILE if path.is_dir() else path
        if not self.path.exists():
            raise CodecError(f"{self.path}: no such compressed file")
        self.verify = verify
        index, self._data_start = read_index(self.path)
        self.metadata: dict[str, Any] = index["metadata"]
        self._entries = {e["name"]: e for e in index["tensors"]}
        self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")  # read_index checked it is not empty

    @property
    def names(self) -> list[str]:
        return list(self._entries)

    def stats(self) -> CompressStats:
        """Sizes from the index (no decoding)."""
        original = sum(
            int(np.prod(e["shape"], dtype=np.int64)) * _itemsize(e["dtype"]) for e in self._entries.values()
        )
        coded = sum(e["codec"] != "raw" for e in self._entries.values())
        return CompressStats(len(self._entries), coded, original, self.path.stat().st_size)

    @property
    def bytes_saved(self) -> int:
        return self.stats().bytes_saved

    def read(self, name: str) -> torch.Tensor:
        """Decode one tensor."""
        if name not in self._entries:
            raise CodecError(f"{self.path}: no tensor named {name!r}")
        entry = self._entries[name]
        try:
            return decode_entry(entry, lambda s: self._section(entry, s), self.verify)
        except CodecError as e:
            raise CodecError(f"{self.path}: {e}") from None

    def _section(self, entry: dict[str, Any], section: str) -> np.ndarray:
        offset, length, crc = entry["sections"][section]
        start = self._data_start + offset
        data = self._mm[start : start + length]
        if zlib.crc32(data) != crc:
            raise CodecError(f"tensor {entry['name']!r}: {section} checksum mismatch (file corrupted)")
        return data

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        start = time.perf_counter()
        for name in self._entries:
            yield name, self.read(name)
        stats = self.stats()
        log.info(
            "decoded %s in %.1f s: %.1f MiB on disk for %.1f MiB of weights, %.1f MiB saved (%.1f%%)",
            self.path,
            time.perf_counter() - start,
            stats.stored_bytes / 2**20,
            stats.original_bytes / 2**20,
            stats.bytes_saved / 2**20,
            100 * (1 - stats.ratio),
        )

    def __len__(self) -> int:
        return len(self._entries)


def open_compressed(path: Path | str, verify: bool = True) -> CompressedFile:
    """Open a `.eiz` file (or a directory holding `model.eiz`); iterate it for `(name, tensor)`."""
    return CompressedFile(path, verify=verify)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _itemsize(dtype: str) -> int:
    return torch.empty((), dtype=getattr(torch, dtype)).element_size()

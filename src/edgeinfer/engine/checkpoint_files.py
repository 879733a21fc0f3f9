"""Which files of a checkpoint directory hold its weights: one list for the loader, the prepared-form
cache's key and the pool's memory estimate. Imports nothing heavy, so the pool may use it before torch."""

from __future__ import annotations

from pathlib import Path

#: weight files the engine reads
READ_SUFFIXES = (".safetensors", ".gguf", ".eiz")
#: weight files in any format, read or not (a conversion never carries them over as side files)
WEIGHT_SUFFIXES = (*READ_SUFFIXES, ".bin", ".pt")


def read_weight_files(path: Path, extra_suffixes: tuple[str, ...] = ()) -> list[Path]:
    """`path` itself if it is a file, else the directory's files the engine reads weights from (and those
    ending in `extra_suffixes`), sorted."""
    if path.is_file():
        return [path]
    wanted = READ_SUFFIXES + extra_suffixes
    return sorted(f for f in path.iterdir() if f.is_file() and f.suffix in wanted)

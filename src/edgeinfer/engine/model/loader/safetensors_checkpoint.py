"""HF checkpoint directories: config.json plus one or more memory-mapped *.safetensors files."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import torch
from safetensors import safe_open

from edgeinfer.engine.model.loader.base import Checkpoint, cast_floating, with_progress
from edgeinfer.engine.model.loader.errors import CheckpointError, one_line

_INDEX_FILE = "model.safetensors.index.json"
_U64 = struct.Struct("<Q")  # the header's length, first in the file
_DTYPES = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "U16": torch.uint16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "I64": torch.int64,
    "U64": torch.uint64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


class SafetensorsCheckpoint(Checkpoint):
    """A directory as `save_pretrained` writes it; the tokenizer files sit in the same directory."""

    format = "safetensors"

    def __init__(self, directory: Path) -> None:
        config = read_config_json(directory)
        self._files = _weight_files(directory)
        # Opening every file now reads and validates each header (and its length against the file size), so
        # a truncated or corrupt shard fails here, before any model memory is spent.
        self._names = {file: _tensor_names(file) for file in self._files}
        super().__init__(directory, config, tokenizer_dir=directory)

    def tensor_names(self) -> list[str]:
        return [name for file in self._files for name in self._names[file]]

    def iter_tensors(self, dtype: torch.dtype | None = torch.float32) -> Iterator[tuple[str, torch.Tensor]]:
        total = sum(len(names) for names in self._names.values())
        yield from with_progress(self._iter_all(dtype), total, desc=f"Loading {self.path.name}")

    def _iter_all(self, dtype: torch.dtype | None) -> Iterator[tuple[str, torch.Tensor]]:
        for file in self._files:
            try:
                for name, tensor in read_tensors(file, self._names[file]):
                    yield name, cast_floating(tensor, dtype)
            except (OSError, RuntimeError, ValueError, KeyError) as exc:
                raise CheckpointError(f"{file}: cannot read tensors ({one_line(exc)})") from exc


def read_tensors(file: Path, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """`names`' tensors of a safetensors file, each read into a tensor of its own. Not through a memory
    map (as `safe_open` reads): every page of a mapped file stays in the process's resident memory until
    the whole file is closed, so loading a checkpoint held it twice, once mapped and once in the model."""
    with open(file, "rb", buffering=0) as f:
        (size,) = _U64.unpack(f.read(_U64.size))
        header = json.loads(f.read(size))
        for name in names:
            info = header[name]
            start, end = info["data_offsets"]
            tensor = torch.empty(info["shape"], dtype=_DTYPES[info["dtype"]])
            f.seek(_U64.size + size + start)
            _read_into(f, tensor, end - start)
            yield name, tensor


def _read_into(f: BinaryIO, tensor: torch.Tensor, nbytes: int) -> None:
    if tensor.numel() * tensor.element_size() != nbytes:
        raise ValueError(f"a tensor's byte range ({nbytes}) does not match its shape and dtype")
    view = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
    done = 0
    while done < nbytes:
        got = f.readinto(view[done:])
        if not got:
            raise ValueError("the file ends inside a tensor")
        done += got


def read_config_json(directory: Path) -> dict[str, Any]:
    """Parse `directory/config.json`; it must be an object naming the model's `architectures`."""
    path = directory / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{directory}: not a checkpoint directory (no config.json)")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: unreadable config ({one_line(exc)})") from exc
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(config).__name__}")
    architectures = config.get("architectures")
    if not isinstance(architectures, list) or not architectures:
        raise CheckpointError(f"{path}: no 'architectures' list, so the model family is unknown")
    return config


def _weight_files(directory: Path) -> list[Path]:
    index = directory / _INDEX_FILE
    if index.is_file():
        return _files_from_index(index)
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{directory}: no *.safetensors weights next to config.json")
    return files


def _files_from_index(index: Path) -> list[Path]:
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{index}: unreadable index ({one_line(exc)})") from exc
    files = [index.parent / name for name in dict.fromkeys(weight_map.values())]
    missing = [file.name for file in files if not file.is_file()]
    if missing:
        raise CheckpointError(f"{index}: lists shards that are missing: {', '.join(missing)}")
    return files


def _tensor_names(file: Path) -> list[str]:
    try:
        with safe_open(str(file), framework="pt") as handle:
            return list(handle.keys())
    except Exception as exc:  # safetensors raises its own SafetensorError besides OSError
        raise CheckpointError(f"{file}: corrupt or truncated safetensors file ({one_line(exc)})") from exc

"""The `.eiz` file: a lossless container of named tensors, bf16 ones exponent-coded.

Layout (little-endian):

    0   magic  b"EDGEIZ\\r\\n"  (the CR LF catches text-mode transfers)
    8   u32    format version (1)
    12  u32    crc32 of the index
    16  u64    index length in bytes
    24  u64    data length in bytes
    32  index  UTF-8 JSON: {"metadata": {...}, "tensors": [entry, ...]}
    ..  zero padding to a multiple of 64, then the data region

An entry is `{name, dtype, shape, codec, sha256, sections: {section: [offset, length, crc32]}}`, offsets
relative to the data region and 64-byte aligned. Codecs: `raw` (section `data`) and `bf16-huffman`
(`sign_mantissa`, `exponents`, `chunk_lengths`, plus `code_lengths`: 256 hex digits). Every section carries
a crc32 and every tensor the sha256 of its original bytes, so a damaged or cut file is refused with the
name of the first tensor it affects.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

from edgeinfer.engine.model.loader.codec.bf16 import EncodedBF16, decode_bf16, encode_bf16

MAGIC = b"EDGEIZ\r\n"
VERSION = 1
HEADER = struct.Struct("<8sIIQQ")
ALIGN = 64
#: bf16 tensors smaller than this are stored raw: coding them saves nothing that matters
MIN_CODED_VALUES = 16384
_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.bfloat16,
        torch.float16,
        torch.float32,
        torch.float64,
        torch.int8,
        torch.uint8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.bool,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
    )
}


class CodecError(ValueError):
    """A compressed file that cannot be read back exactly."""


def tensor_bytes(t: torch.Tensor) -> np.ndarray:
    """The raw bytes of a tensor (flattened, native little-endian)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()


def _sha256(t: torch.Tensor) -> str:
    return hashlib.sha256(tensor_bytes(t)).hexdigest()


class DataWriter:
    """Appends aligned, checksummed sections to the data region."""

    def __init__(self, f: BinaryIO) -> None:
        self.f = f
        self.offset = 0

    def section(self, data: np.ndarray) -> list[int]:
        buf = np.ascontiguousarray(data).view(np.uint8)
        start = self.offset
        self.f.write(buf.tobytes())
        pad = (-len(buf)) % ALIGN
        self.f.write(b"\0" * pad)
        self.offset += len(buf) + pad
        return [start, len(buf), zlib.crc32(buf)]


def encode_entry(out: DataWriter, name: str, t: torch.Tensor) -> dict[str, Any]:
    """Write one tensor's sections; return its index entry."""
    dtype = str(t.dtype).removeprefix("torch.")
    if dtype not in _DTYPES:
        raise CodecError(f"tensor {name!r}: dtype {dtype} is not supported")
    entry: dict[str, Any] = {"name": name, "dtype": dtype, "shape": list(t.shape), "sha256": _sha256(t)}
    enc = encode_bf16(t) if t.dtype == torch.bfloat16 and t.numel() >= MIN_CODED_VALUES else None
    if enc is not None and enc.nbytes() < 2 * t.numel():  # exponents spread over all 256 values: keep raw
        entry["codec"] = "bf16-huffman"
        entry["code_lengths"] = "".join(f"{int(n):x}" for n in enc.code_lengths)
        entry["sections"] = {
            "sign_mantissa": out.section(enc.sign_mantissa),
            "exponents": out.section(enc.exponents),
            "chunk_lengths": out.section(enc.chunk_lengths.astype("<u2")),
        }
    else:
        entry["codec"] = "raw"
        entry["sections"] = {"data": out.section(tensor_bytes(t))}
    return entry


def write_container(
    path: Path,
    entries_writer: Callable[[DataWriter], list[dict[str, Any]]],
    metadata: dict[str, Any] | None = None,
) -> int:
    """Write `path`; `entries_writer(data_writer)` writes the tensors and returns their index entries.

    The data region is written to a side file first because the index, which precedes it, is only known
    at the end. Returns the file size.
    """
    tmp = path.with_name(path.name + ".data.tmp")
    try:
        with open(tmp, "wb") as f:
            writer = DataWriter(f)
            entries = entries_writer(writer)
        index = json.dumps({"metadata": metadata or {}, "tensors": entries}, separators=(",", ":")).encode()
        with open(path, "wb") as f:
            f.write(HEADER.pack(MAGIC, VERSION, zlib.crc32(index), len(index), writer.offset))
            f.write(index)
            f.write(b"\0" * ((-(HEADER.size + len(index))) % ALIGN))
            with open(tmp, "rb") as data:
                shutil.copyfileobj(data, f, length=16 << 20)
    finally:
        tmp.unlink(missing_ok=True)
    return path.stat().st_size


def read_index(path: Path) -> tuple[dict[str, Any], int]:
    """Parse and check the header and index; returns (index, data region start)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(HEADER.size)
        if len(head) < HEADER.size or not head.startswith(MAGIC):
            raise CodecError(f"{path}: not an edgeinfer compressed file (bad magic)")
        _, version, crc, index_len, data_len = HEADER.unpack(head)
        if version != VERSION:
            raise CodecError(f"{path}: unsupported format version {version} (this reader knows {VERSION})")
        raw = f.read(index_len)
    if len(raw) < index_len:
        raise CodecError(f"{path}: truncated inside the index ({size} bytes)")
    if zlib.crc32(raw) != crc:
        raise CodecError(f"{path}: index checksum mismatch (file corrupted)")
    index = json.loads(raw)
    data_start = HEADER.size + index_len + (-(HEADER.size + index_len)) % ALIGN
    for entry in index["tensors"]:
        for name, (offset, length, _) in entry["sections"].items():
            if data_start + offset + length > size:
                raise CodecError(
                    f"{path}: truncated: tensor {entry['name']!r} ({name}) ends at byte "
                    f"{data_start + offset + length}, the file has {size}"
                )
    if data_start + data_len > size:
        raise CodecError(f"{path}: truncated: expected {data_start + data_len} bytes, found {size}")
    return index, data_start


def decode_entry(entry: dict[str, Any], section: Callable[[str], np.ndarray], verify: bool) -> torch.Tensor:
    """Rebuild one tensor; `section(name)` returns that section's checked bytes."""
    shape = tuple(entry["shape"])
    if entry["codec"] == "bf16-huffman":
        enc = EncodedBF16(
            sign_mantissa=section("sign_mantissa"),
            exponents=section("exponents"),
            chunk_lengths=section("chunk_lengths").view("<u2"),
            code_lengths=np.array([int(c, 16) for c in entry["code_lengths"]], dtype=np.uint8),
        )
        try:
            t = decode_bf16(enc, shape)
        except ValueError as e:
            raise CodecError(f"tensor {entry['name']!r}: {e}") from None
    elif entry["codec"] == "raw":
        data, dtype = section("data"), _DTYPES[entry["dtype"]]
        t = (
            torch.from_numpy(data.copy()).view(dtype).reshape(shape)
            if len(data)
            else torch.empty(shape, dtype=dtype)
        )
    else:
        raise CodecError(f"tensor {entry['name']!r}: unknown codec {entry['codec']!r}")
    if verify and _sha256(t) != entry["sha256"]:
        raise CodecError(f"tensor {entry['name']!r}: decoded bytes do not match the stored sha256")
    return t

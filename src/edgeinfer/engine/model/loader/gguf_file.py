"""Reading a GGUF file's header (metadata + tensor table) and dequantizing its tensors.

We parse the header ourselves instead of using `gguf.GGUFReader`: the reader indexes every element of every
metadata array up front, which for Gemma 3's 262k-entry vocabulary takes seconds per open. The model needs
only the scalars and the tensor table, so string arrays are walked past (their length is kept) unless asked
for. The value and quantization types, block sizes and the dequantizers come from the `gguf` package.
"""

from __future__ import annotations

import struct
from collections.abc import Container
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import dequantize

from edgeinfer.engine.model.loader.errors import CheckpointError, one_line

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)  # v1 used 32-bit counts and is long gone
_DEFAULT_ALIGNMENT = 32
_U64 = struct.Struct("<Q")

_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}
# Plain float tensors are "dequantized" too (a view or an upcast); integer tensor types never hold weights.
_READABLE_NAMES = (
    *("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"),
    *("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS"),
    *("TQ1_0", "TQ2_0"),
)
_READABLE_TYPES = frozenset(GGMLQuantizationType[name] for name in _READABLE_NAMES)


@dataclass(frozen=True)
class SkippedStrings:
    """A string array that was not decoded; only its length is known."""

    count: int

    def __len__(self) -> int:
        return self.count


@dataclass(frozen=True)
class TensorInfo:
    """One entry of the tensor table. `shape` is in torch order (slowest dimension first)."""

    name: str
    shape: tuple[int, ...]
    qtype: GGMLQuantizationType
    offset: int  # absolute position in the file
    nbytes: int


class _Cursor:
    """Sequential little-endian reads from a byte buffer, every read bounds-checked."""

    def __init__(self, buf: np.ndarray, path: Path) -> None:
        self.buf, self.path, self.pos = buf, path, 0

    def unpack(self, fmt: str) -> tuple[Any, ...]:
        size = struct.calcsize(fmt)
        self._need(size)
        values = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return values

    def string(self) -> str:
        (length,) = self.unpack("<Q")
        self._need(length)
        raw = bytes(self.buf[self.pos : self.pos + length])
        self.pos += length
        return raw.decode("utf-8", errors="replace")

    def skip_strings(self, count: int) -> None:
        """Walk past `count` strings: one tight loop (far cheaper than an `unpack` per string on a large
        vocabulary), the bounds checked once at the end: every length read lies inside the
        buffer (else struct raises), and a string running past the end leaves `pos` past it."""
        read_length, buf, pos = _U64.unpack_from, self.buf, self.pos
        try:
            for _ in range(count):
                pos += 8 + read_length(buf, pos)[0]
        except struct.error:
            pos = len(buf) + 1
        self._need(pos - self.pos)
        self.pos = pos

    def numbers(self, dtype: str, count: int) -> list[Any]:
        """`count` little-endian numbers of numpy `dtype`, as a list."""
        size = np.dtype(dtype).itemsize * count
        self._need(size)
        values = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos).tolist()
        self.pos += size
        return values

    def _need(self, size: int) -> None:
        if self.pos + size > len(self.buf):
            raise CheckpointError(f"{self.path}: truncated GGUF (header runs past the end of the file)")


class GGUFFile:
    """A GGUF file opened for reading: `metadata` (key → value), `tensors` (the table, in file order)."""

    def __init__(self, path: Path, keep_string_arrays: Container[str] = ()) -> None:
        self.path = path
        try:
            self._buf = np.memmap(path, mode="r", dtype=np.uint8)
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{path}: cannot open GGUF file ({one_line(exc)})") from exc
        cursor = _Cursor(self._buf, path)
        self.metadata, tensor_count = _read_metadata(cursor, keep_string_arrays)
        entries = [_read_tensor_entry(cursor) for _ in range(tensor_count)]
        alignment = int(self.metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
        data_start = -(-cursor.pos // alignment) * alignment
        self.tensors = [_tensor_info(path, data_start, *entry) for entry in entries]
        self._check_extents()

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise CheckpointError(f"{self.path}: GGUF metadata has no general.architecture")
        return arch

    def read(self, info: TensorInfo) -> np.ndarray:
        """Dequantize one tensor to a fresh, writable float32 array of `info.shape`."""
        block, type_size = GGML_QUANT_SIZES[info.qtype]
        byte_shape = (*info.shape[:-1], info.shape[-1] // block * type_size)
        raw = self._buf[info.offset : info.offset + info.nbytes].reshape(byte_shape)
        values = dequantize(raw, info.qtype).reshape(info.shape)
        # F32 comes back as a view of the read-only map; every other type is already a new array.
        return values.copy() if info.qtype == GGMLQuantizationType.F32 else values

    def _check_extents(self) -> None:
        size = len(self._buf)
        for info in self.tensors:
            if info.offset + info.nbytes > size:
                raise CheckpointError(
                    f"{self.path}: truncated GGUF (tensor {info.name} ends at byte "
                    f"{info.offset + info.nbytes}, file has {size})"
                )


def _read_metadata(cursor: _Cursor, keep_string_arrays: Container[str]) -> tuple[dict[str, Any], int]:
    (magic,) = cursor.unpack("<4s")
    if magic != _MAGIC:
        raise CheckpointError(f"{cursor.path}: not a GGUF file (starts with {magic!r}, expected b'GGUF')")
    version, tensor_count, kv_count = cursor.unpack("<IQQ")
    if version not in _VERSIONS:
        raise CheckpointError(f"{cursor.path}: unsupported GGUF version {version} (supported: 2, 3)")
    metadata: dict[str, Any] = {}
    for _ in range(kv_count):
        key = cursor.string()
        (value_type,) = cursor.unpack("<I")
        metadata[key] = _read_value(cursor, _value_type(cursor, value_type), key in keep_string_arrays)
    return metadata, tensor_count


def _read_value(cursor: _Cursor, value_type: GGUFValueType, keep_strings: bool) -> Any:
    if value_type == GGUFValueType.STRING:
        return cursor.string()
    if value_type != GGUFValueType.ARRAY:
        return cursor.unpack(_SCALAR_FORMATS[value_type])[0]
    (raw_type,) = cursor.unpack("<I")
    item_type = _value_type(cursor, raw_type)
    (count,) = cursor.unpack("<Q")
    if item_type == GGUFValueType.STRING:
        if keep_strings:
            return [cursor.string() for _ in range(count)]
        cursor.skip_strings(count)
        return SkippedStrings(count)
    if item_type == GGUFValueType.ARRAY:
        return [_read_value(cursor, GGUFValueType.ARRAY, keep_strings) for _ in range(count)]
    return cursor.numbers(_SCALAR_FORMATS[item_type], count)


def _value_type(cursor: _Cursor, raw: int) -> GGUFValueType:
    try:
        return GGUFValueType(raw)
    except ValueError:
        raise CheckpointError(f"{cursor.path}: corrupt GGUF metadata (unknown value type {raw})") from None


def _read_tensor_entry(cursor: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
    name = cursor.string()
    (n_dims,) = cursor.unpack("<I")
    if n_dims > 8:
        raise CheckpointError(f"{cursor.path}: corrupt GGUF tensor table ({name} claims {n_dims} dimensions)")
    dims = cursor.unpack(f"<{n_dims}Q")
    qtype, offset = cursor.unpack("<IQ")
    # ggml lists the fastest-moving dimension first; torch wants it last.
    return name, tuple(reversed(dims)), qtype, offset


def _tensor_info(
    path: Path, data_start: int, name: str, shape: tuple[int, ...], raw_type: int, offset: int
) -> TensorInfo:
    try:
        qtype = GGMLQuantizationType(raw_type)
    except ValueError:
        raise CheckpointError(f"{path}: tensor {name} has unknown ggml type {raw_type}") from None
    if qtype not in _READABLE_TYPES:
        raise CheckpointError(f"{path}: tensor {name} is stored as {qtype.name}, which cannot be dequantized")
    block, type_size = GGML_QUANT_SIZES[qtype]
    if not shape or shape[-1] % block:
        raise CheckpointError(f"{path}: tensor {name} has shape {shape}, not whole {qtype.name} blocks")
    return TensorInfo(name, shape, qtype, data_start + offset, prod(shape) // block * type_size)

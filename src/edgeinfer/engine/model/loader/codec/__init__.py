"""Lossless bf16 weight codec (exponent Huffman coding) and its `.eiz` container."""

from edgeinfer.engine.model.loader.codec.container import CodecError
from edgeinfer.engine.model.loader.codec.files import (
    COMPRESSED_FILE,
    CompressedFile,
    CompressStats,
    compress_tensors,
    open_compressed,
)

__all__ = [
    "COMPRESSED_FILE",
    "CodecError",
    "CompressStats",
    "CompressedFile",
    "compress_tensors",
    "open_compressed",
]

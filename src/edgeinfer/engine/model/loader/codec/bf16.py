"""Lossless split of bf16 values into a sign+mantissa byte and an exponent byte, exponents Huffman-coded.

LLM weights use few of the 256 exponents (a bell around the weight scale), so their entropy is low and a
Huffman-coded exponent takes a few bits: a bf16 value costs the 8-bit byte plus those, instead of 16. Working
on the raw 16-bit patterns keeps every value, NaN payloads, infinities, signed zeros and subnormals included,
bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from edgeinfer.engine.model.loader.codec import huffman


@dataclass
class EncodedBF16:
    """The sections of one encoded bf16 tensor."""

    sign_mantissa: np.ndarray  # uint8 per value: sign bit, then the 7 mantissa bits
    exponents: np.ndarray  # Huffman stream
    chunk_lengths: np.ndarray  # uint16 per chunk
    code_lengths: np.ndarray  # uint8 per exponent value (0: absent)

    def nbytes(self) -> int:
        return self.sign_mantissa.nbytes + self.exponents.nbytes + self.chunk_lengths.nbytes


def bf16_bits(t: torch.Tensor) -> np.ndarray:
    """The raw uint16 patterns of a bf16 tensor (flattened)."""
    return t.detach().contiguous().view(torch.int16).numpy().view(np.uint16).reshape(-1)


def split(bits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """uint16 patterns -> (sign+mantissa bytes, exponent bytes)."""
    sign_mantissa = (((bits >> 8) & 0x80) | (bits & 0x7F)).astype(np.uint8)
    exponents = ((bits >> 7) & 0xFF).astype(np.uint8)
    return sign_mantissa, exponents


def join(sign_mantissa: np.ndarray, exponents: np.ndarray) -> np.ndarray:
    """Inverse of `split`."""
    sm = sign_mantissa.astype(np.uint16)
    return ((sm & 0x80) << 8) | (exponents.astype(np.uint16) << 7) | (sm & 0x7F)


def encode_bf16(t: torch.Tensor) -> EncodedBF16:
    """Encode a bf16 tensor."""
    sign_mantissa, exponents = split(bf16_bits(t))
    lengths = huffman.code_lengths(np.bincount(exponents, minlength=256))
    stream, chunk_lengths = huffman.encode(exponents, lengths)
    return EncodedBF16(sign_mantissa, stream, chunk_lengths, lengths)


def decode_bf16(enc: EncodedBF16, shape: tuple[int, ...]) -> torch.Tensor:
    """Rebuild the exact bf16 tensor."""
    count = len(enc.sign_mantissa)
    exponents = huffman.decode(enc.exponents, enc.chunk_lengths, count, enc.code_lengths)
    bits = join(enc.sign_mantissa, exponents)
    return torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).reshape(shape)

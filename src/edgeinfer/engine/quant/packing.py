"""Bit-level helpers shared by the weight methods and KV quantizers.

Nibble order: value `2j` is the low nibble of byte `j`, `2j+1` the high one. On a little-endian machine a
`[..., K/2]` uint8 tensor in this order *is* compressed-tensors' int32 packing (value `i` of a word at bits
`4i..4i+3`) viewed as bytes, so converting between the two is a zero-copy `view`.
"""

from __future__ import annotations

import sys

import torch

from edgeinfer.engine.quant.base import QuantizationError

if sys.byteorder != "little":  # the int32 <-> byte views below assume it
    raise ImportError("edgeinfer quantization needs a little-endian machine")


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """Pack values in [0, 15] along the last dim, two per byte: `[..., K]` -> uint8 `[..., K/2]`."""
    if q.shape[-1] % 2:
        raise QuantizationError(f"cannot pack an odd number ({q.shape[-1]}) of 4-bit values")
    q = q.to(torch.uint8)
    return q[..., 0::2] | (q[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_nibbles`: uint8 `[..., K/2]` -> uint8 `[..., K]`."""
    return torch.stack((packed & 15, packed >> 4), dim=-1).flatten(-2)


def nibbles_to_int32(packed: torch.Tensor) -> torch.Tensor:
    """uint8 nibble bytes `[..., K/2]` -> compressed-tensors int32 words `[..., K/8]` (a view)."""
    if packed.shape[-1] % 4:
        raise QuantizationError(f"4-bit rows of {2 * packed.shape[-1]} values are not a multiple of 8")
    # through a flat view: `.contiguous()` may keep odd strides on size-1 dims, which `.view(dtype)` rejects
    return packed.contiguous().reshape(-1).view(torch.int32).reshape(*packed.shape[:-1], -1)


def int32_to_nibbles(words: torch.Tensor) -> torch.Tensor:
    """compressed-tensors int32 words `[..., K/8]` -> uint8 nibble bytes `[..., K/2]` (a view)."""
    if words.dtype != torch.int32:
        raise QuantizationError(f"packed 4-bit weights must be int32, got {words.dtype}")
    return words.contiguous().reshape(-1).view(torch.uint8).reshape(*words.shape[:-1], -1)


def unpack_rows_int32(words: torch.Tensor, rows: int) -> torch.Tensor:
    """compressed-tensors' integer zero points, 4-bit values packed along dim -2 (8 rows to an int32 word,
    the last word padded): int32 `[..., ceil(rows/8), G]` -> uint8 `[..., rows, G]`."""
    q = unpack_nibbles(int32_to_nibbles(words.transpose(-1, -2).contiguous())).transpose(-1, -2)
    return q[..., :rows, :].contiguous()


# float8 e4m3 (bias 7) -> bf16 (bias 127): put the 7 exponent+mantissa bits where bf16 keeps its low
# exponent bits and top mantissa bits, then multiply by 2**(127 - 7). fp8 subnormals become bf16
# subnormals first and come out exact after the multiply. The NaN code 0x7F maps to a finite value: the
# callers multiply by a scale that is NaN whenever the quantized data held a NaN.
_E4M3_REBIAS = 2.0 ** (127 - 7)
_E5M2_REBIAS = 2.0 ** (127 - 15)


def _fp8_bits_to_bf16(bits: torch.Tensor, mantissa_bits: int, rebias: float) -> torch.Tensor:
    # int8 -> int16 sign-extends, so after the shift the sign sits in bit 15 (and in the bits the mask drops)
    shift = 7 - mantissa_bits
    mask = -(1 << 15) | (0x7F << shift)  # bit 15 + the 7 exponent/mantissa bits, as a signed int16
    out = bits.view(torch.int8).to(torch.int16).bitwise_left_shift_(shift).bitwise_and_(mask)
    return out.view(torch.bfloat16).mul_(rebias)


def fp8_to_bf16(x: torch.Tensor) -> torch.Tensor:
    """Fast exact float8 (e4m3fn or e5m2) -> bf16 on CPU, where `.to()` is a slow scalar loop."""
    if x.device.type != "cpu":
        return x.to(torch.bfloat16)
    if x.dtype == torch.float8_e4m3fn:
        return _fp8_bits_to_bf16(x, 3, _E4M3_REBIAS)
    if x.dtype == torch.float8_e5m2:
        return _fp8_bits_to_bf16(x, 2, _E5M2_REBIAS)
    raise QuantizationError(f"fp8_to_bf16 got {x.dtype}")

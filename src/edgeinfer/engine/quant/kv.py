"""KV-cache quantizers, keyed by `--kv-cache-dtype`.

A quantizer turns `[T, H, D]` (T tokens, H KV heads, D head_dim; MLA latents are `[T, 1, latent_dim]`) into
a payload `[T, H, D']` and scales `[T, H, S]`, so the paged pool is two tensors,
`[num_blocks, block_size, H, D']` and `[num_blocks, block_size, H, S]`, written and gathered by slot index.
Each token's scales depend only on that token, so identical prefixes give identical blocks (prefix caching
works unchanged) and a token never needs re-quantizing when others join its block.

| dtype | payload | scales (per token, per head) | worst error (a = amax of the token-head or group) |
|---|---|---|---|
| bf16 / auto | model dtype | none (S = 0) | none for auto, bf16 rounding for bf16 |
| int8 | int8 | 1 fp32 | a/254 |
| fp8_e4m3 / fp8_e5m2 | float8 | 1 fp32 | 2^-4 / 2^-3 relative (normal range) |
| int4 | uint8, 2 per byte | D/32 bf16, symmetric per 32 | a/14 per group |
"""

from __future__ import annotations

import math
import mmap
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import ClassVar

import torch

from edgeinfer.engine.quant.base import QuantizationError
from edgeinfer.engine.quant.packing import fp8_to_bf16, pack_nibbles


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """`torch.zeros`; on the CPU in an anonymous memory map, whose pages the kernel hands out zeroed when
    they are first touched (calloc's way for large blocks): zeroing a large pool up front would slow the
    start, and its blocks are touched only as requests fill them."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)  # the tensor keeps the map


class KVQuantizer(ABC):
    """How one K or V tensor is stored in the paged pool."""

    name: str
    storage_dtype: torch.dtype
    scale_dtype: torch.dtype = torch.float32
    #: values packed into one payload element (2 for int4)
    values_per_element: ClassVar[int] = 1

    @property
    def bytes_per_value(self) -> float:
        """Payload bytes per cached value (scales excluded)."""
        return torch.empty((), dtype=self.storage_dtype).element_size() / self.values_per_element

    def payload_dim(self, head_dim: int) -> int:
        """D' of the payload for a given head_dim."""
        self.check_head_dim(head_dim)
        return head_dim // self.values_per_element

    @abstractmethod
    def scale_shape(self, num_heads: int, head_dim: int) -> tuple[int, int]:
        """(H, S) of one token's scales."""

    def check_head_dim(self, head_dim: int) -> None:
        """Raise QuantizationError when this dtype cannot store rows of `head_dim` values."""
        if head_dim < 1:
            raise QuantizationError(f"head_dim must be >= 1, got {head_dim}")

    def bytes_per_token(self, num_heads: int, head_dim: int) -> int:
        """Bytes one token occupies in one pool (K or V of one layer), scales included."""
        payload = (
            num_heads * self.payload_dim(head_dim) * torch.empty((), dtype=self.storage_dtype).element_size()
        )
        h, s = self.scale_shape(num_heads, head_dim)
        return payload + h * s * torch.empty((), dtype=self.scale_dtype).element_size()

    @abstractmethod
    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`[T, H, D]` -> (payload `[T, H, D']`, scales `[T, H, S]`)."""

    @abstractmethod
    def dequantize(self, payload: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """(payload, scales) with any leading dims -> values `[..., H, D]` in `dtype`."""

    def allocate(
        self,
        num_blocks: int,
        block_size: int,
        num_heads: int,
        head_dim: int,
        device: torch.device | str = "cpu",
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Zeroed pool tensors: payload `[B, bs, H, D']` and scales `[B, bs, H, S]`."""
        payload = zeroed(
            (num_blocks, block_size, num_heads, self.payload_dim(head_dim)), self.storage_dtype, device
        )
        scales = zeroed(
            (num_blocks, block_size, *self.scale_shape(num_heads, head_dim)), self.scale_dtype, device
        )
        return payload, scales

    def write(
        self, payload_pool: torch.Tensor, scale_pool: torch.Tensor, slots: torch.Tensor, x: torch.Tensor
    ) -> None:
        """Quantize `x [T, H, D]` into flat slots `slots [T]` (slot = block * block_size + offset)."""
        payload, scales = self.quantize(x)
        # flatten(0, 1) of a contiguous pool is a view, so index_copy_ writes into the pool itself
        _as_bytes(payload_pool).flatten(0, 1).index_copy_(0, slots, _as_bytes(payload))
        scale_pool.flatten(0, 1).index_copy_(0, slots, scales)

    def read(
        self, payload_pool: torch.Tensor, scale_pool: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        """Gather and dequantize slots (any shape) -> `[*slots.shape, H, D]`."""
        payload = _as_bytes(payload_pool).flatten(0, 1)[slots].view(payload_pool.dtype)
        scales = scale_pool.flatten(0, 1)[slots]
        return self.dequantize(payload, scales, dtype)

    def gather_blocks(
        self,
        payload_pool: torch.Tensor,
        scale_pool: torch.Tensor,
        block_ids: torch.Tensor,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """Dequantized contents of whole blocks: `block_ids [..., n]` -> `[..., n * block_size, H, D]`."""
        payload = take_blocks(_as_bytes(payload_pool), block_ids).view(payload_pool.dtype).flatten(-4, -3)
        return self.dequantize(payload, take_blocks(scale_pool, block_ids).flatten(-4, -3), dtype)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name})"


def take_blocks(pool: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """`pool[block_ids]` for a `[num_blocks, ...]` pool: `[*block_ids.shape, ...]`.

    `index_select` on the flattened ids: on CPU several times faster than advanced indexing for a decode
    step's gather, which runs for every layer's K and V.
    """
    rows = torch.index_select(pool, 0, block_ids.reshape(-1))
    return rows.view(*block_ids.shape, *pool.shape[1:])


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """float8 tensors as uint8 (CPU index_copy_ and indexing lack float8 kernels); others unchanged."""
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t


def _check_input(x: torch.Tensor) -> None:
    if x.dim() != 3:
        raise QuantizationError(f"KV tensor must be [tokens, heads, head_dim], got {tuple(x.shape)}")


class NullKV(KVQuantizer):
    """Values stored as they are (in `storage_dtype`); no scales."""

    def __init__(self, name: str, storage_dtype: torch.dtype) -> None:
        self.name = name
        self.storage_dtype = storage_dtype

    def scale_shape(self, num_heads: int, head_dim: int) -> tuple[int, int]:
        return (num_heads, 0)

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        _check_input(x)
        return x.to(self.storage_dtype), x.new_empty((*x.shape[:2], 0), dtype=self.scale_dtype)

    def dequantize(self, payload: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return payload.to(dtype)


class Int8KV(KVQuantizer):
    """Symmetric int8, one fp32 scale per token and head."""

    name = "int8"
    storage_dtype = torch.int8

    def scale_shape(self, num_heads: int, head_dim: int) -> tuple[int, int]:
        return (num_heads, 1)

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        _check_input(x)
        xf = x.float()
        scale = xf.abs().amax(-1, keepdim=True) / 127
        scale = torch.where(scale == 0, torch.ones_like(scale), scale)
        return torch.round(xf / scale).clamp_(-127, 127).to(torch.int8), scale

    def dequantize(self, payload: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        # in the compute dtype: for bf16 this is much faster than going through fp32 (attention reads every
        # cached value each step) and adds two bf16 roundings (2^-8 relative each), below the int8 step
        return payload.to(dtype) * scales.to(dtype)


class Fp8KV(KVQuantizer):
    """float8 (e4m3fn or e5m2) with one fp32 scale per token and head; amax maps to the format's max."""

    def __init__(self, name: str, storage_dtype: torch.dtype) -> None:
        self.name = name
        self.storage_dtype = storage_dtype
        self._max = torch.finfo(storage_dtype).max

    def scale_shape(self, num_heads: int, head_dim: int) -> tuple[int, int]:
        return (num_heads, 1)

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        _check_input(x)
        xf = x.float()
        scale = xf.abs().amax(-1, keepdim=True) / self._max
        scale = torch.where(scale == 0, torch.ones_like(scale), scale)
        # clamp first: torch turns out-of-range values into NaN instead of saturating
        return (xf / scale).clamp_(-self._max, self._max).to(self.storage_dtype), scale

    def dequantize(self, payload: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return fp8_to_bf16(payload).to(dtype) * scales.to(dtype)


class Int4KV(KVQuantizer):
    """Symmetric int4 per group of 32 along head_dim, bf16 scales, two values per byte (offset by 8)."""

    name = "int4"
    storage_dtype = torch.uint8
    scale_dtype = torch.bfloat16
    values_per_element = 2
    group = 32

    def check_head_dim(self, head_dim: int) -> None:
        if head_dim < 1 or head_dim % self.group:
            raise QuantizationError(f"int4 KV cache needs head_dim divisible by {self.group}, got {head_dim}")

    def scale_shape(self, num_heads: int, head_dim: int) -> tuple[int, int]:
        self.check_head_dim(head_dim)
        return (num_heads, head_dim // self.group)

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        _check_input(x)
        self.check_head_dim(x.shape[-1])
        groups = x.float().unflatten(-1, (-1, self.group))
        scale = (groups.abs().amax(-1) / 7).to(torch.bfloat16)
        scale = torch.where(scale == 0, torch.ones_like(scale), scale)
        q = torch.round(groups / scale.float().unsqueeze(-1)).clamp_(-7, 7).add_(8)
        return pack_nibbles(q.flatten(-2)), scale

    def dequantize(self, payload: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        # unpack straight into the output and scale in place: no temporaries, unlike stack + out-of-place ops
        lead, half = payload.shape[:-1], payload.shape[-1]
        out = torch.empty(*lead, half, 2, dtype=dtype, device=payload.device)
        out[..., 0] = payload & 15
        out[..., 1] = payload >> 4
        groups = (
            out.view(*lead, 2 * half // self.group, self.group).sub_(8).mul_(scales.to(dtype).unsqueeze(-1))
        )
        return groups.view(*lead, 2 * half)


_KV_QUANTIZERS: dict[str, Callable[[torch.dtype], KVQuantizer]] = {
    "auto": lambda compute: NullKV("auto", compute),
    "bf16": lambda compute: NullKV("bf16", torch.bfloat16),
    "fp8_e4m3": lambda compute: Fp8KV("fp8_e4m3", torch.float8_e4m3fn),
    "fp8_e5m2": lambda compute: Fp8KV("fp8_e5m2", torch.float8_e5m2),
    "int8": lambda compute: Int8KV(),
    "int4": lambda compute: Int4KV(),
}
KV_CACHE_DTYPES = tuple(_KV_QUANTIZERS)


def get_kv_quantizer(name: str, compute_dtype: torch.dtype = torch.bfloat16) -> KVQuantizer:
    """The quantizer for `--kv-cache-dtype name`; `auto` stores the model's compute dtype unchanged."""
    if name not in _KV_QUANTIZERS:
        raise QuantizationError(f"unknown kv_cache_dtype {name!r} (choose from {', '.join(KV_CACHE_DTYPES)})")
    return _KV_QUANTIZERS[name](compute_dtype)

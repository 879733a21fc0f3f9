"""Paged KV storage: per layer a K pool (and a V pool), addressed by flat slot = block * block_size + offset.

With several KV groups (kv_cache/groups.py) a block holds `groups.slots` layers: there are that many K (and
V) pools, and each layer uses the pool of its slot in its group, so the layers at one slot of different
groups share a pool, each group writing only the blocks in its own tables.

Values pass through a `KVQuantizer` (`--kv-cache-dtype`): quantized when written, dequantized when gathered
for attention. The default (`auto`) stores the compute dtype as is and takes a copy-free fast path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from edgeinfer.engine.kv_cache.groups import KVGroups, single_group
from edgeinfer.engine.quant.kv import Fp8KV, Int8KV, KVQuantizer, NullKV, get_kv_quantizer, take_blocks


@dataclass(frozen=True)
class KVSpec:
    """The KV layout a model declares: per layer, K with `k_heads × k_dim` and V with `v_heads × v_dim`
    values per token. MLA declares one latent as K (`k_heads=1`, `k_dim = kv_lora_rank + rope_dim`) and
    no V (`v_dim = 0`), so the pool, prefix cache and quantizers need no special case for it."""

    num_layers: int
    k_heads: int
    k_dim: int
    v_heads: int
    v_dim: int
    windows: tuple[int | None, ...] = ()  # per layer, its sliding window (None: full); empty: all full

    def values_per_token_per_layer(self) -> int:
        return self.k_heads * self.k_dim + self.v_heads * self.v_dim

    def layer_windows(self) -> tuple[int | None, ...]:
        return self.windows or (None,) * self.num_layers


def kv_bytes_per_token(spec: KVSpec, quantizer: KVQuantizer) -> int:
    """Bytes one token occupies across all layers, scales included."""
    per_layer = quantizer.bytes_per_token(spec.k_heads, spec.k_dim)
    if spec.v_dim:
        per_layer += quantizer.bytes_per_token(spec.v_heads, spec.v_dim)
    return per_layer * spec.num_layers


def kv_block_bytes(spec: KVSpec, quantizer: KVQuantizer, block_size: int, groups: KVGroups) -> int:
    """Bytes one block occupies: `block_size` tokens of the `groups.slots` layers it holds."""
    return kv_bytes_per_token(spec, quantizer) // spec.num_layers * groups.slots * block_size


class _Pool:
    """One paged tensor (K or V of one layer) with its per-token scales."""

    def __init__(
        self, q: KVQuantizer, blocks: int, block_size: int, heads: int, dim: int, device: torch.device
    ) -> None:
        self.q = q
        self.data, self.scales = q.allocate(blocks, block_size, heads, dim, device)
        self.plain = isinstance(q, NullKV)

    def write(self, slots: torch.Tensor, x: torch.Tensor) -> None:
        if self.plain:
            self.data.view(-1, *self.data.shape[2:]).index_copy_(0, slots, x.to(self.data.dtype))
        else:
            self.q.write(self.data, self.scales, slots, x)

    def gather(self, block_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if self.plain:  # `to` is free when the stored dtype is the compute dtype (the default, `auto`)
            return take_blocks(self.data, block_ids).flatten(-4, -3).to(dtype)
        return self.q.gather_blocks(self.data, self.scales, block_ids, dtype)


class KVCacheStorage:
    """Holds the paged K/V pools `[num_blocks + 1, block_size, heads, dim]` of every layer (of every slot,
    with KV groups: `groups`, one group of every layer by default).

    Blocks 1..num_blocks hold sequences (the block pool's ids); block 0 is the null block that block-table
    padding points at. It is zeroed at allocation and never written, so a padded gather reads finite zeros.
    """

    def __init__(
        self,
        spec: KVSpec,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        kv_cache_dtype: str = "auto",
        groups: KVGroups | None = None,
    ) -> None:
        self.spec = spec
        self.groups = groups or single_group(spec.num_layers)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype  # the compute dtype attention sees
        self.quantizer = get_kv_quantizer(kv_cache_dtype, dtype)
        q = self.quantizer
        physical = num_blocks + 1  # with the null block
        slots = range(self.groups.slots)
        k = [_Pool(q, physical, block_size, spec.k_heads, spec.k_dim, device) for _ in slots]
        v = [_Pool(q, physical, block_size, spec.v_heads, spec.v_dim, device) for _ in slots if spec.v_dim]
        self._pools = k + v
        layers = [self.groups.slot_of(layer) for layer in range(spec.num_layers)]
        self.k = [k[slot] for slot in layers]
        self.v: list[_Pool | None] = [v[slot] if v else None for slot in layers]

    def group_of(self, layer: int) -> int:
        return self.groups.group_of(layer)

    @property
    def lossless(self) -> bool:
        """Whether gathered K/V equal what was written (no quantization)."""
        return isinstance(self.quantizer, NullKV) and self.quantizer.storage_dtype == self.dtype

    @property
    def kernel_readable(self) -> bool:
        """Whether our CPU decode attention (kernels/decode_ops.cpp) reads the pools where they lie: a bf16
        compute dtype over bf16 values, or over int8 / float8 codes with one scale per token and head."""
        q = self.quantizer
        plain = isinstance(q, NullKV) and q.storage_dtype == torch.bfloat16
        return self.dtype == torch.bfloat16 and (plain or isinstance(q, (Int8KV, Fp8KV)))

    def kernel_pools(
        self, layer: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """A layer's K and V pools as our decode attention takes them, with their scales (None in bf16)."""
        kp, vp = self.k[layer], self.v[layer]
        assert vp is not None, "a layer without V (MLA) has no K/V pools"
        if kp.plain:
            return kp.data, vp.data, None, None
        return kp.data, vp.data, kp.scales, vp.scales

    def zero_blocks(self, block_ids: list[int]) -> None:
        """Scrub blocks. Attention reads whole blocks and masks the slots past a sequence's end; a masked
        NaN still poisons the output (0 × NaN), so NaN left by a failed request must not outlive it."""
        if not block_ids:
            return
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.k[0].data.device)
        for pool in self._pools:
            for t in (pool.data, pool.scales):  # as bytes: float8 has no index_fill_ on CPU
                t.view(torch.uint8).index_fill_(0, idx, 0)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None) -> None:
        """Store new tokens' K [T, heads, dim] (and V) at their flat slots."""
        self.k[layer].write(slots, k)
        if v is not None:
            self.v[layer].write(slots, v)

    def gather(self, layer: int, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """K (and V) of the given blocks, `block_ids` [..., n] → [..., n * block_size, heads, dim]."""
        vp = self.v[layer]
        return self.k[layer].gather(block_ids, self.dtype), (vp.gather(block_ids, self.dtype) if vp else None)

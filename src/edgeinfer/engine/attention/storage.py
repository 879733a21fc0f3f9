"""Paged KV storage: one tensor pair per layer, addressed by flat slot = block * block_size + offset."""

from __future__ import annotations

from dataclasses import dataclass

import torch


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

    def values_per_token_per_layer(self) -> int:
        return self.k_heads * self.k_dim + self.v_heads * self.v_dim


class KVCacheStorage:
    """Holds the paged K/V tensors `[num_blocks, block_size, heads, dim]` for every layer."""

    def __init__(
        self, spec: KVSpec, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.spec = spec
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        shape_k = (num_blocks, block_size, spec.k_heads, spec.k_dim)
        shape_v = (num_blocks, block_size, spec.v_heads, spec.v_dim)
        self.k = [torch.zeros(shape_k, dtype=dtype, device=device) for _ in range(spec.num_layers)]
        self.v = [
            torch.zeros(shape_v, dtype=dtype, device=device) if spec.v_dim else None
            for _ in range(spec.num_layers)
        ]

    @staticmethod
    def bytes_per_token(spec: KVSpec, dtype: torch.dtype) -> int:
        """Bytes one token occupies across all layers."""
        elem = torch.empty((), dtype=dtype).element_size()
        return spec.values_per_token_per_layer() * spec.num_layers * elem

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None) -> None:
        """Store new tokens' K [T, heads, dim] (and V) at their flat slots."""
        self.k[layer].view(-1, *self.k[layer].shape[2:]).index_copy_(0, slots, k.to(self.dtype))
        if v is not None:
            vc = self.v[layer]
            vc.view(-1, *vc.shape[2:]).index_copy_(0, slots, v.to(self.dtype))

    def gather(self, layer: int, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """K (and V) of the given blocks, `block_ids` [..., n] → [..., n * block_size, heads, dim]."""
        k = self.k[layer][block_ids].flatten(-4, -3)
        vc = self.v[layer]
        return k, (vc[block_ids].flatten(-4, -3) if vc is not None else None)

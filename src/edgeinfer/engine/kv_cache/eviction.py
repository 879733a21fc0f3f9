"""Which tenant's cached free block is evicted when a fresh block is needed.

`TenantShareEviction` evicts from the owner furthest over its share: held / share is largest, where
held counts the owner's cached free blocks and share is its weight (tenants file `cache_share`,
default 1). A tenant flooding the cache therefore grows only its own pile, and its own least recently
used blocks go first; a quiet tenant's blocks survive until the flooder is down to the same weighted
size. `LRUEviction` is the shared global LRU, kept to measure what the shares buy.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from edgeinfer.engine.kv_cache.block_pool import BlockPool


class EvictionPolicy(ABC):
    @abstractmethod
    def victim(self, pool: BlockPool) -> str | None:
        """The owner whose least recently freed cached block goes; None: the global LRU block."""


class LRUEviction(EvictionPolicy):
    def victim(self, pool: BlockPool) -> str | None:
        return None


class TenantShareEviction(EvictionPolicy):
    def victim(self, pool: BlockPool) -> str | None:
        best, best_ratio = None, -1.0
        for owner, queue in pool.cached_free_by_owner.items():
            if not queue:
                continue
            ratio = len(queue) / pool.shares.get(owner, 1.0)
            if ratio > best_ratio:
                best, best_ratio = owner, ratio
        return best


def make_eviction(tenant_shares: bool) -> EvictionPolicy:
    return TenantShareEviction() if tenant_shares else LRUEviction()

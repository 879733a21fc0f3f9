"""Paged KV-cache bookkeeping: block pool, namespaced prefix cache, per-request block tables. No torch."""

from edgeinfer.engine.kv_cache.block_pool import NULL_BLOCK, BlockPool
from edgeinfer.engine.kv_cache.manager import KVCacheManager

__all__ = ["NULL_BLOCK", "BlockPool", "KVCacheManager"]

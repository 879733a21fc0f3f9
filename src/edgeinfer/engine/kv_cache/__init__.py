"""Paged KV-cache bookkeeping: block pool, namespaced prefix cache, per-request block tables. No torch."""

from edgeinfer.engine.kv_cache.block_pool import BlockPool
from edgeinfer.engine.kv_cache.manager import KVCacheManager

__all__ = ["BlockPool", "KVCacheManager"]

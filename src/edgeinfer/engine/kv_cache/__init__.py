"""Paged KV-cache bookkeeping: block pool, KV groups, namespaced prefix cache, per-request block tables.
No torch."""

from edgeinfer.engine.kv_cache.block_pool import NULL_BLOCK, BlockPool
from edgeinfer.engine.kv_cache.groups import KVGroup, KVGroups, plan_groups, single_group
from edgeinfer.engine.kv_cache.manager import KVCacheManager
from edgeinfer.engine.kv_cache.prefix import PrefixHit

__all__ = [
    "NULL_BLOCK",
    "BlockPool",
    "KVCacheManager",
    "KVGroup",
    "KVGroups",
    "PrefixHit",
    "plan_groups",
    "single_group",
]

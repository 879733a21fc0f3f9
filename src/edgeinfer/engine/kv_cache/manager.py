"""Per-request block tables over the block pool, and the namespaced prefix cache."""

from __future__ import annotations

from collections import Counter

from edgeinfer.engine.kv_cache.block_pool import BlockPool
from edgeinfer.engine.kv_cache.hashing import chain_hashes


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class KVCacheManager:
    """Owns which blocks each request holds. Returns block ids; never edits a request."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.tables: dict[str, list[int]] = {}
        self._hashes: dict[str, list[bytes]] = {}
        self._namespaces: dict[str, str] = {}
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of which found in cache

    def lookup(self, namespace: str, token_ids: list[int]) -> tuple[list[int], int]:
        """Longest cached prefix of whole blocks: (block ids, tokens covered). At least the last
        token is left uncached so the request's first step still computes logits."""
        self.prefix_queries += len(token_ids)
        if not self.enable_prefix_caching:
            return [], 0
        usable = (len(token_ids) - 1) // self.block_size
        blocks = []
        for h in chain_hashes(namespace, token_ids[: usable * self.block_size], self.block_size):
            block = self.pool.lookup(h)
            if block is None:
                break
            blocks.append(block)
        self.prefix_hits += len(blocks) * self.block_size
        return blocks, len(blocks) * self.block_size

    def allocate(
        self, request_id: str, num_tokens: int, prefix_blocks: list[int] | None = None, namespace: str = ""
    ) -> list[int] | None:
        """Grow the request's table to hold `num_tokens` tokens; None (and nothing changed) if the pool
        lacks blocks. A new request starts from `prefix_blocks` returned by `lookup`."""
        table = self.tables.get(request_id)
        if table is None:
            return self._allocate_new(request_id, num_tokens, prefix_blocks or [], namespace)
        need = blocks_for(num_tokens, self.block_size) - len(table)
        if need > 0:
            new = self.pool.allocate(need)
            if new is None:
                return None
            table.extend(new)
        return table

    def _allocate_new(
        self, request_id: str, num_tokens: int, prefix: list[int], namespace: str
    ) -> list[int] | None:
        need = blocks_for(num_tokens, self.block_size) - len(prefix)
        revived = sum(1 for b in prefix if self.pool.ref_cnt[b] == 0)
        if need + revived > self.pool.num_free:
            return None
        for block in prefix:
            self.pool.acquire(block)
        table = prefix + (self.pool.allocate(max(need, 0)) or [])
        self.tables[request_id] = table
        self._hashes[request_id] = [self.pool.block_hash[b] for b in prefix]
        self._namespaces[request_id] = namespace
        return table

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.pool.num_free

    def cache_full_blocks(self, request_id: str, token_ids: list[int], num_computed: int) -> None:
        """Index the request's blocks that became full of computed tokens."""
        if not self.enable_prefix_caching:
            return
        hashes = self._hashes[request_id]
        full = num_computed // self.block_size
        if full <= len(hashes):
            return
        parent = hashes[-1] if hashes else None
        new = chain_hashes(
            self._namespaces[request_id],
            token_ids[: full * self.block_size],
            self.block_size,
            start=len(hashes),
            parent=parent,
        )
        table = self.tables[request_id]
        for i, h in enumerate(new, start=len(hashes)):
            self.pool.register(table[i], h)
        hashes.extend(new)

    def exclusive_blocks(self, request_id: str) -> list[int]:
        """Blocks only this request references, dropped from the prefix index: their content is about to be
        discarded as garbage (e.g. NaN K/V of a failed request) and must never be served as a prefix."""
        blocks = [b for b in self.tables.get(request_id, []) if self.pool.ref_cnt[b] == 1]
        for block in blocks:
            self.pool.forget(block)
        return blocks

    def free(self, request_id: str) -> None:
        table = self.tables.pop(request_id, None)
        if table is None:
            return
        self._hashes.pop(request_id)
        self._namespaces.pop(request_id)
        self.pool.release(table[::-1])

    def num_cached_blocks(self) -> int:
        return len(self.pool.cached)

    def check_integrity(self) -> None:
        refs = Counter(b for table in self.tables.values() for b in table)
        self.pool.check_integrity(dict(refs))

"""Per-request block tables over the block pool, and the namespaced prefix cache."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from edgeinfer.engine.kv_cache.block_pool import BlockPool
from edgeinfer.engine.kv_cache.eviction import make_eviction
from edgeinfer.engine.kv_cache.hashing import PUBLIC_NAMESPACE, iter_hashes, tail_root, takes_public_prefixes


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


@dataclass
class _Chain:
    """One request's hash chain: `hashes[i]` identifies its block i; the first `num_public` are blocks
    of a public prefix, and the block after them hashes from `root` in the request's own namespace."""

    namespace: str
    owner: str
    root: bytes
    num_public: int
    hashes: list[bytes] = field(default_factory=list)

    def parent(self) -> bytes:
        return self.hashes[-1] if len(self.hashes) > self.num_public else self.root


class KVCacheManager:
    """Owns which blocks each request holds. Returns block ids; never edits a request."""

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, tenant_shares: bool = True
    ) -> None:
        self.pool = BlockPool(num_blocks, make_eviction(tenant_shares))
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.tables: dict[str, list[int]] = {}
        self._chains: dict[str, _Chain] = {}
        self.pinned: list[int] = []  # public-prefix blocks, one reference each for the engine's lifetime
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of which found in cache

    def lookup(self, namespace: str, token_ids: list[int]) -> tuple[list[int], int]:
        """Longest cached prefix of whole blocks: (block ids, tokens covered): the public prefix it
        starts with, if any, then the blocks of `namespace`. At least the last token is left uncached so
        the request's first step still computes logits."""
        self.prefix_queries += len(token_ids)
        if not self.enable_prefix_caching:
            return [], 0
        bs = self.block_size
        tokens = token_ids[: (len(token_ids) - 1) // bs * bs]
        public = (self.pinned and takes_public_prefixes(namespace)) or namespace == PUBLIC_NAMESPACE
        blocks = self._walk(iter_hashes(PUBLIC_NAMESPACE, tokens, bs)) if public else []
        if namespace != PUBLIC_NAMESPACE:
            root = tail_root(namespace, self.pool.block_hash[blocks[-1]] if blocks else None)
            blocks += self._walk(iter_hashes(namespace, tokens, bs, start=len(blocks), parent=root))
        self.prefix_hits += len(blocks) * bs
        return blocks, len(blocks) * bs

    def _walk(self, hashes: Iterable[bytes]) -> list[int]:
        blocks = []
        for h in hashes:
            block = self.pool.lookup(h)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def allocate(
        self,
        request_id: str,
        num_tokens: int,
        prefix_blocks: list[int] | None = None,
        namespace: str = "",
        owner: str = "",
        reserve: int = 0,
    ) -> list[int] | None:
        """Grow the request's table to hold `num_tokens` tokens; None (and nothing changed) if the pool
        lacks blocks. A new request starts from `prefix_blocks` returned by `lookup`, and only if `reserve`
        blocks stay free beside it; the blocks it computes are charged to `owner` (its tenant) once freed."""
        table = self.tables.get(request_id)
        if table is None:
            return self._allocate_new(request_id, num_tokens, prefix_blocks or [], namespace, owner, reserve)
        need = blocks_for(num_tokens, self.block_size) - len(table)
        if need > 0:
            new = self.pool.allocate(need, self._chains[request_id].owner)
            if new is None:
                return None
            table.extend(new)
        return table

    def _allocate_new(
        self, request_id: str, num_tokens: int, prefix: list[int], namespace: str, owner: str, reserve: int
    ) -> list[int] | None:
        need = blocks_for(num_tokens, self.block_size) - len(prefix)
        revived = sum(1 for b in prefix if self.pool.ref_cnt[b] == 0)
        if need + revived + reserve > self.pool.num_free:
            return None
        for block in prefix:
            self.pool.acquire(block)
        table = prefix + (self.pool.allocate(max(need, 0), owner) or [])
        self.tables[request_id] = table
        # Prefix blocks come from lookup, so every one is indexed.
        hashes = [h for b in prefix if (h := self.pool.block_hash[b]) is not None]
        public = set(self.pinned)
        num_public = next((i for i, b in enumerate(prefix) if b not in public), len(prefix))
        if namespace == PUBLIC_NAMESPACE:
            num_public = len(prefix)
        root = tail_root(namespace, hashes[num_public - 1] if num_public else None)
        self._chains[request_id] = _Chain(namespace, owner, root, num_public, hashes)
        return table

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.pool.num_free

    def cache_full_blocks(self, request_id: str, token_ids: list[int], num_computed: int) -> None:
        """Index the request's blocks that became full of computed tokens."""
        if not self.enable_prefix_caching:
            return
        chain = self._chains[request_id]
        full = num_computed // self.block_size
        start = len(chain.hashes)
        if full <= start:
            return
        new = list(
            iter_hashes(
                chain.namespace, token_ids[: full * self.block_size], self.block_size, start, chain.parent()
            )
        )
        table = self.tables[request_id]
        for i, h in enumerate(new, start=start):
            self.pool.register(table[i], h, chain.owner)
        chain.hashes.extend(new)

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Give back the request's blocks past the first `num_tokens` tokens (taken for draft tokens that
        were rejected). They were never indexed: only blocks full of computed tokens are, and a rejected
        draft is never counted as computed."""
        table = self.tables.get(request_id)
        keep = blocks_for(num_tokens, self.block_size)
        if table is None or len(table) <= keep:
            return
        tail = table[keep:]
        del table[keep:]
        self.pool.release(tail[::-1])

    def pin(self, blocks: list[int]) -> int:
        """Keep cached blocks (a public prefix computed at load) for good: each gets one reference that
        is never released. Returns how many blocks are pinned now."""
        for block in blocks:
            if block not in self.pinned:
                self.pool.acquire(block)
                self.pinned.append(block)
        return len(self.pinned)

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
        self._chains.pop(request_id)
        self.pool.release(table[::-1])

    def num_cached_blocks(self) -> int:
        return len(self.pool.cached)

    def check_integrity(self) -> None:
        refs = Counter(b for table in self.tables.values() for b in table)
        refs.update(self.pinned)
        self.pool.check_integrity(dict(refs))

"""Per-request block tables over the block pool, one per KV group (groups.py), and the namespaced prefix
cache (prefix.py).

Every group's table of a request has one entry per block of its tokens, so token p lies in entry
p // block_size of each. A windowed group holds real blocks only where its window still reaches: entries
before that are NULL_BLOCK (never allocated, or given back once the window moved past them), which
attention never reads since a windowed layer starts at its window.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from edgeinfer.engine.kv_cache.block_pool import NULL_BLOCK, BlockPool
from edgeinfer.engine.kv_cache.eviction import make_eviction
from edgeinfer.engine.kv_cache.groups import KVGroup
from edgeinfer.engine.kv_cache.hashing import PUBLIC_NAMESPACE, iter_hashes, tail_root, takes_public_prefixes
from edgeinfer.engine.kv_cache.prefix import PrefixHit, PrefixWalk, group_key

Tables = list[list[int]]  # per group, a request's block table


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


@dataclass
class _Chain:
    """One request's hash chain: `hashes[i]` identifies its block i; the first `num_public` are blocks
    of a public prefix, and the block after them hashes from `root` in the request's own namespace.
    `num_computed`: its tokens computed so far, which tells where its windows start; `released`: per group,
    the table entries before this one are null (given back, or never needed)."""

    namespace: str
    owner: str
    root: bytes
    num_public: int
    hashes: list[bytes] = field(default_factory=list)
    num_computed: int = 0
    released: list[int] = field(default_factory=list)

    def parent(self) -> bytes:
        return self.hashes[-1] if len(self.hashes) > self.num_public else self.root


class KVCacheManager:
    """Owns which blocks each request holds. Returns block ids; never edits a request. `windows`: per KV
    group, its layers' window (None: full attention); one full-attention group by default."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        tenant_shares: bool = True,
        windows: Sequence[int | None] = (None,),
    ) -> None:
        self.pool = BlockPool(num_blocks, make_eviction(tenant_shares))
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.groups = tuple(KVGroup(w, ()) for w in windows)
        self.tables: dict[str, Tables] = {}
        self._chains: dict[str, _Chain] = {}
        self.pinned: list[int] = []  # public-prefix blocks, one reference each for the engine's lifetime
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of which found in cache

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    def lookup(self, namespace: str, token_ids: list[int]) -> PrefixHit:
        """Longest cached prefix of whole blocks that every group serves (prefix.py): the public prefix it
        starts with, if any, then the blocks of `namespace`. At least the last token is left uncached so
        the request's first step still computes logits."""
        self.prefix_queries += len(token_ids)
        if not self.enable_prefix_caching:
            return PrefixHit.empty(self.num_groups)
        bs = self.block_size
        tokens = token_ids[: (len(token_ids) - 1) // bs * bs]
        walk = PrefixWalk(self.pool, self.groups, bs)
        if (self.pinned and takes_public_prefixes(namespace)) or namespace == PUBLIC_NAMESPACE:
            walk.extend(iter_hashes(PUBLIC_NAMESPACE, tokens, bs))
            walk.cut()
        num_public = walk.best
        if namespace != PUBLIC_NAMESPACE:
            root = tail_root(namespace, walk.hashes[-1] if walk.hashes else None)
            walk.extend(iter_hashes(namespace, tokens, bs, start=num_public, parent=root))
        self.prefix_hits += walk.best * bs
        return walk.hit(num_public)

    def allocate(
        self,
        request_id: str,
        num_tokens: int,
        prefix: PrefixHit | None = None,
        namespace: str = "",
        owner: str = "",
        reserve: int = 0,
    ) -> Tables | None:
        """Grow the request's tables to hold `num_tokens` tokens; None (and nothing changed) if the pool
        lacks blocks. A new request starts from the `prefix` that `lookup` returned, and only if `reserve`
        blocks stay free beside it; the blocks it computes are charged to `owner` (its tenant) once freed."""
        tables = self.tables.get(request_id)
        if tables is None:
            hit = prefix or PrefixHit.empty(self.num_groups)
            return self._allocate_new(request_id, num_tokens, hit, namespace, owner, reserve)
        chain = self._chains[request_id]
        need = self._growth(tables, chain.num_computed, num_tokens)
        if need:
            new = self.pool.allocate(need, chain.owner)
            if new is None:
                return None
            self._grow(tables, chain.num_computed, num_tokens, new)
        return tables

    def _allocate_new(
        self, request_id: str, num_tokens: int, hit: PrefixHit, namespace: str, owner: str, reserve: int
    ) -> Tables | None:
        tables = [list(t) for t in hit.tables]
        need = self._growth(tables, hit.num_tokens, num_tokens)
        prefix = hit.blocks()
        revived = sum(1 for b in prefix if self.pool.ref_cnt[b] == 0)
        if need + revived + reserve > self.pool.num_free:
            return None
        for block in prefix:
            self.pool.acquire(block)
        self._grow(tables, hit.num_tokens, num_tokens, self.pool.allocate(need, owner) or [])
        self.tables[request_id] = tables
        p = hit.num_public
        root = tail_root(namespace, hit.hashes[p - 1] if p else None)
        released = [self._first_block(g, hit.num_tokens) for g in range(self.num_groups)]
        chain = _Chain(namespace, owner, root, p, list(hit.hashes), hit.num_tokens, released)
        self._chains[request_id] = chain
        return tables

    def _growth(self, tables: Tables, num_computed: int, num_tokens: int) -> int:
        """Blocks the tables need to hold `num_tokens` tokens, `num_computed` of them computed."""
        return sum(self._group_growth(g, t, num_computed, num_tokens) for g, t in enumerate(tables))

    def _group_growth(self, g: int, table: list[int], num_computed: int, num_tokens: int) -> int:
        start = max(len(table), self._first_block(g, num_computed))
        return max(0, blocks_for(num_tokens, self.block_size) - start)

    def _grow(self, tables: Tables, num_computed: int, num_tokens: int, new: list[int]) -> None:
        end = blocks_for(num_tokens, self.block_size)
        taken = iter(new)
        for g, table in enumerate(tables):
            first = self._first_block(g, num_computed)
            table.extend(NULL_BLOCK if i < first else next(taken) for i in range(len(table), end))

    def _first_block(self, g: int, num_computed: int) -> int:
        """The first block group g still needs once `num_computed` tokens are computed."""
        return self.groups[g].first_needed(num_computed) // self.block_size

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.pool.num_free

    def peak_blocks(self, num_tokens: int, chunk: int) -> int:
        """The most blocks a request of `num_tokens` tokens holds at once, computed `chunk` tokens a step
        at most."""
        n = blocks_for(num_tokens, self.block_size)
        return sum(self._most(g, chunk, n) for g in range(self.num_groups))

    def _most(self, g: int, chunk: int, blocks: int) -> int:
        """The most of `blocks` blocks group g holds at once, computed `chunk` tokens a step at most: a
        windowed group its window and the chunk (and the blocks either straddles), a full one all."""
        window = self.groups[g].window
        return blocks if window is None else min(blocks, blocks_for(window - 1 + chunk, self.block_size) + 1)

    def num_held(self, request_id: str) -> int:
        """Blocks the request holds, in every group."""
        return sum(len(t) - t.count(NULL_BLOCK) for t in self.tables.get(request_id, ()))

    def blocks_short(self, request_id: str, num_tokens: int, chunk: int) -> int:
        """Blocks the running request still takes on the way to `num_tokens` tokens, `chunk` tokens a step
        at most (a windowed group gives blocks back as it goes: never more than it holds at most)."""
        computed = self._chains[request_id].num_computed
        grow = [self._group_growth(g, t, computed, num_tokens) for g, t in enumerate(self.tables[request_id])]
        return sum(self._most(g, chunk, n) for g, n in enumerate(grow))

    def commit(self, request_id: str, token_ids: list[int], num_computed: int) -> None:
        """The request has computed its first `num_computed` tokens: index the blocks they filled, then give
        back the windowed groups' blocks that no later query can see (indexed first, they stay cached)."""
        self.cache_full_blocks(request_id, token_ids, num_computed)
        chain = self._chains[request_id]
        chain.num_computed = num_computed
        gone = []
        for g, table in enumerate(self.tables[request_id]):
            end = min(self._first_block(g, num_computed), len(table))
            for i in range(chain.released[g], end):
                gone.append(table[i])
                table[i] = NULL_BLOCK
            chain.released[g] = max(chain.released[g], end)
        self.pool.release(gone[::-1])

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
        for g, table in enumerate(self.tables[request_id]):
            for i, h in enumerate(new, start=start):
                if table[i] != NULL_BLOCK:
                    self.pool.register(table[i], group_key(h, g), chain.owner)
        chain.hashes.extend(new)

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Give back the request's blocks past the first `num_tokens` tokens (taken for draft tokens that
        were rejected). They were never indexed: only blocks full of computed tokens are, and a rejected
        draft is never counted as computed."""
        keep = blocks_for(num_tokens, self.block_size)
        tail = []
        for table in self.tables.get(request_id, ()):
            tail += [b for b in table[keep:] if b != NULL_BLOCK]
            del table[keep:]
        self.pool.release(tail[::-1])

    def pin(self, hit: PrefixHit) -> int:
        """Keep a hit's cached blocks (a public prefix computed at load) for good: each gets one reference
        that is never released. Returns how many blocks are pinned now."""
        for block in hit.blocks():
            if block not in self.pinned:
                self.pool.acquire(block)
                self.pinned.append(block)
        return len(self.pinned)

    def exclusive_blocks(self, request_id: str) -> list[int]:
        """Blocks only this request references, dropped from the prefix index: their content is about to be
        discarded as garbage (e.g. NaN K/V of a failed request) and must never be served as a prefix."""
        held = [b for t in self.tables.get(request_id, ()) for b in t if b != NULL_BLOCK]
        blocks = [b for b in held if self.pool.ref_cnt[b] == 1]
        for block in blocks:
            self.pool.forget(block)
        return blocks

    def free(self, request_id: str) -> None:
        tables = self.tables.pop(request_id, None)
        if tables is None:
            return
        self._chains.pop(request_id)
        # tail first in every group: a sequence's head, the likeliest to be shared, is evicted last
        width = max(len(t) for t in tables)
        order = [t[i] for i in reversed(range(width)) for t in tables if i < len(t) and t[i] != NULL_BLOCK]
        self.pool.release(order)

    def num_cached_blocks(self) -> int:
        return len(self.pool.cached)

    def in_use(self, group: int) -> int:
        """Blocks the running requests hold in one group."""
        return len({b for tables in self.tables.values() for b in tables[group] if b != NULL_BLOCK})

    def check_integrity(self) -> None:
        """The pool's books (free + in use == total, ref counts equal the tables' and pins' references),
        and no block in two groups' tables at once."""
        refs = Counter(b for tables in self.tables.values() for t in tables for b in t if b != NULL_BLOCK)
        refs.update(self.pinned)
        self.pool.check_integrity(dict(refs))
        seen: set[int] = set()
        for g in range(self.num_groups):
            mine = {b for tables in self.tables.values() for b in tables[g] if b != NULL_BLOCK}
            if mine & seen:
                shared = sorted(mine & seen)[:10]
                raise AssertionError(f"group {g} shares blocks with another group: {shared}")
            seen |= mine

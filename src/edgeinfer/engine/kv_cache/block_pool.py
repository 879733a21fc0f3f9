"""Fixed-size KV blocks with reference counts, free queues and a content-hash index.

A block with ref count 0 is free. If it still carries a hash it is also in the prefix index and can be
revived by a later request with the same prefix until `allocate` reuses (evicts) it. Free blocks without
a hash are handed out first (reusing them evicts nothing). Among cached free blocks each tenant that
computed them (their owner) has an LRU queue; the eviction policy (eviction.py) picks whose queue gives
up its least-recently-freed block, so one tenant's flood evicts its own blocks before anyone else's.

A block handed to a tenant other than the one whose request last held it is listed in `dirty`; the
engine scrubs those before the step runs, so no slot of a reused block holds another tenant's K/V even
where attention reads it masked.

Block ids run 1..num_blocks: id 0 is the null block (`NULL_BLOCK`), never allocated, so nothing a request
computes is ever written there. Block tables are padded with it; a backend that reads past a sequence's
blocks (a batch's padded gather) sees only the null block's zeros, never another sequence's K/V.
"""

from __future__ import annotations

from collections import Counter, OrderedDict

from edgeinfer.engine.kv_cache.eviction import EvictionPolicy, TenantShareEviction

NULL_BLOCK = 0


class BlockPool:
    def __init__(self, num_blocks: int, eviction: EvictionPolicy | None = None) -> None:
        if num_blocks < 1:
            raise ValueError("the KV pool needs at least one block")
        self.num_blocks = num_blocks  # usable blocks, the null block not counted
        self.eviction = eviction or TenantShareEviction()
        self.ref_cnt = [0] * (num_blocks + 1)
        self.block_hash: list[bytes | None] = [None] * (num_blocks + 1)
        self.owner: list[str] = [""] * (num_blocks + 1)
        self.last_holder: list[str | None] = [None] * (num_blocks + 1)  # None: never written
        self.dirty: list[int] = []
        self.plain_free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks + 1))
        # Cached free blocks: all of them in LRU order, and per owner in LRU order.
        self.cached_free: OrderedDict[int, None] = OrderedDict()
        self.cached_free_by_owner: dict[str, OrderedDict[int, None]] = {}
        self.cached: dict[bytes, int] = {}
        self.shares: dict[str, float] = {}  # owner -> weight of its share of cached free blocks
        self.evicted_by_owner: Counter[str] = Counter()
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        return len(self.plain_free) + len(self.cached_free)

    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    def held_by_owner(self) -> dict[str, int]:
        """Cached free blocks each owner holds (what its quota bounds)."""
        return {owner: len(q) for owner, q in self.cached_free_by_owner.items() if q}

    def set_share(self, owner: str, share: float) -> None:
        if share <= 0:
            raise ValueError(f"a tenant's cache share must be > 0, got {share}")
        self.shares[owner] = share

    def allocate(self, n: int, holder: str = "") -> list[int] | None:
        """Take n free blocks for `holder` (plain ones first, then evicting cached ones), or None
        (nothing changed)."""
        if n > self.num_free:
            return None
        out = []
        for _ in range(n):
            block = self._take_free()
            self.ref_cnt[block] = 1  # in use before unindexing, so it does not go back to a free queue
            self._drop_hash(block)
            if self.last_holder[block] not in (None, holder):
                self.dirty.append(block)
            self.last_holder[block] = holder
            out.append(block)
        return out

    def take_dirty(self) -> list[int]:
        """Blocks reused across tenants since the last call, to scrub before they are written."""
        dirty, self.dirty = self.dirty, []
        return dirty

    def _take_free(self) -> int:
        if self.plain_free:
            return self.plain_free.popitem(last=False)[0]
        owner = self.eviction.victim(self)
        queue = self.cached_free_by_owner[owner] if owner is not None else self.cached_free
        block = next(iter(queue))
        self._unlink_free(block)
        self.evicted_by_owner[self.owner[block]] += 1
        return block

    def lookup(self, block_hash: bytes) -> int | None:
        return self.cached.get(block_hash)

    def acquire(self, block: int) -> None:
        """Add a reference to a cached block (a prefix hit), reviving it from the free queue if needed."""
        if self.ref_cnt[block] == 0:
            self._unlink_free(block)
        self.ref_cnt[block] += 1

    def release(self, blocks: list[int]) -> None:
        """Drop one reference from each block. Callers pass a request's blocks tail first so that the
        tail of a sequence, the least likely to be shared, is evicted before its head."""
        for block in blocks:
            self.ref_cnt[block] -= 1
            assert self.ref_cnt[block] >= 0, f"block {block} released twice"
            if self.ref_cnt[block] == 0:
                self._link_free(block)

    def register(self, block: int, block_hash: bytes, owner: str = "") -> None:
        """Record that a full block holds the content identified by `block_hash`, computed for `owner`."""
        if self.block_hash[block] is not None or block_hash in self.cached:
            return  # already indexed, or an identical block computed concurrently is the canonical copy
        self.block_hash[block] = block_hash
        self.owner[block] = owner
        self.cached[block_hash] = block

    def forget(self, block: int) -> None:
        """Drop one block's prefix-index entry (its content will not be reused)."""
        self._drop_hash(block)

    def reset_prefix_cache(self) -> int:
        """Forget every unreferenced cached block; returns how many were dropped."""
        dropped = list(self.cached_free)
        for block in dropped:
            self._drop_hash(block)
        return len(dropped)

    def _link_free(self, block: int) -> None:
        if self.block_hash[block] is None:
            self.plain_free[block] = None
            return
        self.cached_free[block] = None
        self.cached_free_by_owner.setdefault(self.owner[block], OrderedDict())[block] = None

    def _unlink_free(self, block: int) -> None:
        if block in self.plain_free:
            del self.plain_free[block]
            return
        del self.cached_free[block]
        del self.cached_free_by_owner[self.owner[block]][block]

    def _drop_hash(self, block: int) -> None:
        """Unindex a block. A free one moves to the plain queue's tail: its content is gone, so it is
        taken before any cached block, which still has content worth keeping."""
        h = self.block_hash[block]
        if h is None:
            return
        free = self.ref_cnt[block] == 0
        if free:
            self._unlink_free(block)
        self.num_evictions += 1
        del self.cached[h]
        self.block_hash[block] = None
        self.owner[block] = ""
        if free:
            self._link_free(block)

    def check_integrity(self, expected_refs: dict[int, int] | None = None) -> None:
        """Invariants: free + in use == total; the free queues hold exactly the ref-0 blocks, cached ones
        exactly once per owner; the hash index and per-block hashes agree; with `expected_refs`, ref
        counts equal the owners' count."""
        free = set(self.plain_free) | set(self.cached_free)
        if self.ref_cnt[NULL_BLOCK] or NULL_BLOCK in free or self.block_hash[NULL_BLOCK]:
            raise AssertionError("the null block was allocated, referenced or indexed")
        in_use = [b for b in range(1, self.num_blocks + 1) if self.ref_cnt[b] > 0]
        if len(free) + len(in_use) != self.num_blocks or free & set(in_use) or len(free) != self.num_free:
            raise AssertionError(
                f"block accounting broken: {len(free)} free + {len(in_use)} in use != {self.num_blocks}"
            )
        by_owner = [b for q in self.cached_free_by_owner.values() for b in q]
        if sorted(by_owner) != sorted(self.cached_free):
            raise AssertionError("per-owner free queues disagree with the cached free queue")
        if any(self.block_hash[b] is None for b in self.cached_free) or any(
            self.block_hash[b] is not None for b in self.plain_free
        ):
            raise AssertionError("a free block sits in the wrong queue for its hash")
        for owner, q in self.cached_free_by_owner.items():
            if any(self.owner[b] != owner for b in q):
                raise AssertionError(f"a block in {owner!r}'s free queue belongs to someone else")
        for h, b in self.cached.items():
            if self.block_hash[b] != h:
                raise AssertionError(f"prefix index points at block {b} whose hash differs")
        if sum(h is not None for h in self.block_hash) != len(self.cached):
            raise AssertionError("a block carries a hash that the prefix index lacks")
        if expected_refs is not None:
            actual = {b: self.ref_cnt[b] for b in in_use}
            if actual != expected_refs:
                leaked = sorted(set(actual) - set(expected_refs))
                raise AssertionError(f"KV blocks leaked or miscounted: leaked={leaked[:10]}")

"""Fixed-size KV blocks with reference counts, an LRU free queue and a content-hash index.

A block with ref count 0 sits in the free queue. If it still carries a hash it is also in the prefix
index and can be revived by a later request with the same prefix until `allocate` reuses (evicts) it.
The free queue is ordered least-recently-freed first, so eviction is LRU over unreferenced blocks.

Block ids run 1..num_blocks: id 0 is the null block (`NULL_BLOCK`), never allocated, so nothing a request
computes is ever written there. Block tables are padded with it; a backend that reads past a sequence's
blocks (a batch's padded gather) sees only the null block's zeros, never another sequence's K/V.
"""

from __future__ import annotations

from collections import OrderedDict

NULL_BLOCK = 0


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError("the KV pool needs at least one block")
        self.num_blocks = num_blocks  # usable blocks, the null block not counted
        self.ref_cnt = [0] * (num_blocks + 1)
        self.block_hash: list[bytes | None] = [None] * (num_blocks + 1)
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks + 1))
        self.cached: dict[bytes, int] = {}
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    def allocate(self, n: int) -> list[int] | None:
        """Take n blocks from the head of the free queue (evicting their cached content), or None."""
        if n > len(self.free_queue):
            return None
        out = []
        for _ in range(n):
            block, _ = self.free_queue.popitem(last=False)
            self._drop_hash(block)
            self.ref_cnt[block] = 1
            out.append(block)
        return out

    def lookup(self, block_hash: bytes) -> int | None:
        return self.cached.get(block_hash)

    def acquire(self, block: int) -> None:
        """Add a reference to a cached block (a prefix hit), reviving it from the free queue if needed."""
        if self.ref_cnt[block] == 0:
            del self.free_queue[block]
        self.ref_cnt[block] += 1

    def release(self, blocks: list[int]) -> None:
        """Drop one reference from each block. Callers pass a request's blocks tail first so that the
        tail of a sequence, the least likely to be shared, is evicted before its head."""
        for block in blocks:
            self.ref_cnt[block] -= 1
            assert self.ref_cnt[block] >= 0, f"block {block} released twice"
            if self.ref_cnt[block] == 0:
                self.free_queue[block] = None

    def register(self, block: int, block_hash: bytes) -> None:
        """Record that a full block holds the content identified by `block_hash`."""
        if self.block_hash[block] is not None or block_hash in self.cached:
            return  # already indexed, or an identical block computed concurrently is the canonical copy
        self.block_hash[block] = block_hash
        self.cached[block_hash] = block

    def forget(self, block: int) -> None:
        """Drop one block's prefix-index entry (its content will not be reused)."""
        self._drop_hash(block)

    def reset_prefix_cache(self) -> int:
        """Forget every unreferenced cached block; returns how many were dropped."""
        dropped = [b for b in self.free_queue if self.block_hash[b] is not None]
        for block in dropped:
            self._drop_hash(block)
        return len(dropped)

    def _drop_hash(self, block: int) -> None:
        h = self.block_hash[block]
        if h is not None:
            self.num_evictions += 1
            del self.cached[h]
            self.block_hash[block] = None

    def check_integrity(self, expected_refs: dict[int, int] | None = None) -> None:
        """Invariants: free + in use == total; the free queue holds exactly the ref-0 blocks; the hash
        index and per-block hashes agree; with `expected_refs`, ref counts equal the owners' count."""
        if self.ref_cnt[NULL_BLOCK] or NULL_BLOCK in self.free_queue or self.block_hash[NULL_BLOCK]:
            raise AssertionError("the null block was allocated, referenced or indexed")
        in_use = [b for b in range(1, self.num_blocks + 1) if self.ref_cnt[b] > 0]
        free = set(self.free_queue)
        if len(free) + len(in_use) != self.num_blocks or free & set(in_use):
            raise AssertionError(
                f"block accounting broken: {len(free)} free + {len(in_use)} in use != {self.num_blocks}"
            )
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

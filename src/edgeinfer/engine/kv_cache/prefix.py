"""Prefix-cache hits across KV groups (groups.py).

A hit of k whole blocks lets a request skip computing its first k blocks' tokens: its next query, at
position k * block_size, reads every earlier key in a full-attention group but only the last `window` in a
windowed one. So a full-attention group serves the hit only with all k blocks cached, a windowed group with
just the blocks its window reaches from there (those before it may long have been evicted), and the hit is
the longest for which every group has what it needs.

Each group indexes its blocks under the chain hash (hashing.py) and its group number, so one prompt's
blocks in different groups, which hold different layers' K/V, never stand in for each other.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from edgeinfer.engine.kv_cache.block_pool import NULL_BLOCK, BlockPool
from edgeinfer.engine.kv_cache.groups import KVGroup


def group_key(block_hash: bytes, group: int) -> bytes:
    """What group `group`'s block of this content is indexed under (group 0's: the chain hash itself)."""
    return block_hash if group == 0 else block_hash + group.to_bytes(2, "little")


@dataclass(frozen=True)
class PrefixHit:
    """`num_tokens` cached tokens: per group, the hit's blocks in table order (NULL_BLOCK where the group
    needs none); the blocks' chain hashes, of which the first `num_public` are a public prefix's."""

    tables: list[list[int]]
    hashes: list[bytes]
    num_public: int
    num_tokens: int

    @staticmethod
    def empty(num_groups: int) -> PrefixHit:
        return PrefixHit([[] for _ in range(num_groups)], [], 0, 0)

    def blocks(self) -> list[int]:
        """Every block of the hit, each group's in turn."""
        return [b for table in self.tables for b in table if b != NULL_BLOCK]


class PrefixWalk:
    """Looks up a prompt's block hashes in every group, one block at a time, and keeps the longest hit that
    every group serves (`best` blocks)."""

    def __init__(self, pool: BlockPool, groups: tuple[KVGroup, ...], block_size: int) -> None:
        self.pool = pool
        self.groups = groups
        self.block_size = block_size
        self.hashes: list[bytes] = []
        self.found: list[list[int]] = [[] for _ in groups]  # per group and walked block: it, or NULL_BLOCK
        self.runs = [0] * len(groups)  # per group: how many of the last walked blocks it has, in a row
        self.best = 0

    def extend(self, hashes: Iterable[bytes]) -> None:
        """Walk on; stops where a full-attention group misses a block (no later hit can be served)."""
        for h in hashes:
            row = [self.pool.lookup(group_key(h, g)) for g in range(len(self.groups))]
            if any(b is None and grp.window is None for b, grp in zip(row, self.groups, strict=True)):
                return
            self.hashes.append(h)
            for g, b in enumerate(row):
                self.found[g].append(NULL_BLOCK if b is None else b)
                self.runs[g] = 0 if b is None else self.runs[g] + 1
            if all(self._serves(g, len(self.hashes)) for g in range(len(self.groups))):
                self.best = len(self.hashes)

    def _serves(self, g: int, k: int) -> bool:
        first = self.groups[g].first_needed(k * self.block_size) // self.block_size
        return self.runs[g] >= k - first

    def cut(self) -> None:
        """Forget what was walked past the best hit (to walk on from there in another namespace)."""
        del self.hashes[self.best :]
        for g, found in enumerate(self.found):
            del found[self.best :]
            self.runs[g] = next((i for i, b in enumerate(reversed(found)) if b == NULL_BLOCK), len(found))

    def hit(self, num_public: int) -> PrefixHit:
        k = self.best
        tables = []
        for grp, found in zip(self.groups, self.found, strict=True):
            first = grp.first_needed(k * self.block_size) // self.block_size
            tables.append([NULL_BLOCK] * first + found[first:k])
        return PrefixHit(tables, self.hashes[:k], num_public, k * self.block_size)

"""Block pool and KV manager invariants (no torch, no model)."""

import pytest

from edgeinfer.engine.kv_cache import BlockPool, KVCacheManager


def test_allocate_release_and_integrity():
    pool = BlockPool(4)
    a = pool.allocate(3)
    assert a is not None and len(set(a)) == 3 and pool.num_free == 1
    assert pool.allocate(2) is None and pool.num_free == 1  # refused without side effects
    pool.release(a[::-1])
    assert pool.num_free == 4
    pool.check_integrity({})


def test_double_release_is_caught():
    pool = BlockPool(2)
    a = pool.allocate(1)
    pool.release(a)
    with pytest.raises(AssertionError):
        pool.release(a)


def test_lru_eviction_prefers_least_recently_freed():
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    for blk, h in ((a, b"a"), (b, b"b"), (c, b"c")):
        pool.register(blk, h)
    pool.release([b])
    pool.release([a])
    pool.release([c])
    (first,) = pool.allocate(1)
    assert first == b and pool.lookup(b"b") is None  # b was freed first, so evicted first
    assert pool.lookup(b"a") == a and pool.lookup(b"c") == c
    pool.check_integrity({first: 1})


def test_prefix_hit_shares_blocks_and_counts_refs():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    prompt = list(range(10))
    hit = kv.lookup("", prompt)
    assert (hit.tables, hit.num_tokens) == ([[]], 0)
    (table,) = kv.allocate("r1", 10, hit)
    kv.cache_full_blocks("r1", prompt, 10)
    hit = kv.lookup("", prompt + [99])
    assert hit.num_tokens == 8 and hit.tables == [table[:2]]
    (t2,) = kv.allocate("r2", 11, hit)
    assert t2[:2] == table[:2] and kv.pool.ref_cnt[table[0]] == 2
    kv.check_integrity()
    kv.free("r1")
    kv.free("r2")
    kv.check_integrity()
    assert kv.pool.num_free == 8


def test_lookup_always_leaves_a_token_to_compute():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    prompt = list(range(8))
    kv.allocate("r1", 8)
    kv.cache_full_blocks("r1", prompt, 8)
    assert kv.lookup("", prompt).num_tokens == 4  # the second block would leave nothing to compute


def test_namespaces_never_share_blocks():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    prompt = list(range(12))
    kv.allocate("a", 12, namespace="tenant-a")
    kv.cache_full_blocks("a", prompt, 12)
    assert kv.lookup("tenant-b", prompt).num_tokens == 0
    assert kv.lookup("tenant-a", prompt).num_tokens == 8


def test_freed_cached_blocks_revive_until_evicted():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    prompt = list(range(9))
    kv.allocate("a", 9)
    kv.cache_full_blocks("a", prompt, 9)
    kv.free("a")
    hit = kv.lookup("", prompt)
    assert hit.num_tokens == 8
    assert kv.allocate("b", 9, hit) is not None
    kv.check_integrity()
    kv.free("b")
    kv.allocate("c", 16)  # needs every block: evicts the cached ones
    assert kv.lookup("", prompt).num_tokens == 0
    kv.free("c")
    kv.check_integrity()


def test_new_request_counts_revived_blocks_against_free_space():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    prompt = list(range(9))
    kv.allocate("a", 9)
    kv.cache_full_blocks("a", prompt, 9)
    kv.free("a")
    hit = kv.lookup("", prompt)
    kv.allocate("hog", 4)  # one free block left, two cached-but-free blocks wanted back
    assert kv.allocate("b", 13, hit) is None  # needs 2 revived + 2 new > 2 free
    kv.check_integrity()

"""Tenants in the KV cache, torch-free: shares of cached blocks, public prefixes, salted namespaces."""

from __future__ import annotations

import pytest

from edgeinfer.engine.kv_cache import KVCacheManager
from edgeinfer.engine.kv_cache.hashing import PUBLIC_NAMESPACE
from edgeinfer.types.cache_salt import derive_salt, encode_fields, tenant_salt

BS = 4


def _cache(kv: KVCacheManager, rid: str, tokens: list[int], tenant: str) -> None:
    """One request that computes `tokens` in tenant's namespace, then finishes (its blocks stay cached)."""
    prefix = kv.lookup(tenant, tokens)
    assert kv.allocate(rid, len(tokens), prefix, tenant, owner=tenant) is not None
    kv.cache_full_blocks(rid, tokens, len(tokens))
    kv.free(rid)


def _prompt(seed: int, blocks: int) -> list[int]:
    return [1000 * seed + i for i in range(blocks * BS + 1)]


@pytest.mark.parametrize("shares", [True, False])
def test_a_flooding_tenant_evicts_its_own_blocks_first(shares: bool) -> None:
    kv = KVCacheManager(num_blocks=24, block_size=BS, tenant_shares=shares)
    victim = _prompt(1, 4)
    _cache(kv, "v", victim, "victim")
    for i in range(10):  # 10 x 4 blocks through a 24-block pool: the pool turns over twice
        _cache(kv, f"f{i}", _prompt(100 + i, 4), "flooder")
        kv.check_integrity()
    kept = kv.lookup("victim", victim).num_tokens
    if shares:
        assert kept == 4 * BS  # the flooder, far over its share, gave up its own blocks every time
        assert kv.pool.evicted_by_owner["flooder"] > 0 and kv.pool.evicted_by_owner["victim"] == 0
        assert kv.pool.held_by_owner()["victim"] == 4
    else:
        assert kept == 0  # one global LRU: the victim's older blocks went first
        assert kv.pool.evicted_by_owner["victim"] == 4


def test_shares_weight_what_each_tenant_keeps() -> None:
    kv = KVCacheManager(num_blocks=61, block_size=BS)
    kv.pool.set_share("big", 2.0)
    for i in range(100):  # both tenants keep caching one-block prompts until the pool turned over
        _cache(kv, f"b{i}", _prompt(1000 + i, 1), "big")
        _cache(kv, f"s{i}", _prompt(2000 + i, 1), "small")
    held = kv.pool.held_by_owner()
    # 2:1 within the blocks a running request holds outside the count (2 of them here).
    assert sum(held.values()) == 60 and 38 <= held["big"] <= 42, held
    kv.check_integrity()


def test_a_reused_block_is_unindexed_before_its_new_owner_writes() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    a = _prompt(1, 2)
    _cache(kv, "a", a, "A")
    table = kv.allocate("b", 3 * BS, [], "B", owner="B")  # needs every block: A's are evicted
    assert table is not None and kv.lookup("A", a).num_tokens == 0
    (blocks,) = table
    assert all(kv.pool.block_hash[b] is None and kv.pool.owner[b] == "" for b in blocks)
    assert sorted(kv.pool.take_dirty()) == sorted(blocks)  # all three were written for A: to scrub
    kv.free("b")
    kv.check_integrity()


def _pin_public(kv: KVCacheManager, public: list[int]) -> list[int]:
    _cache(kv, "public", public, PUBLIC_NAMESPACE)
    hit = kv.lookup(PUBLIC_NAMESPACE, [*public, 0])
    kv.pin(hit)
    return hit.blocks()


def test_public_prefix_is_shared_and_tails_stay_private() -> None:
    kv = KVCacheManager(num_blocks=32, block_size=BS)
    public = list(range(3 * BS))
    pinned = _pin_public(kv, public)
    assert len(pinned) == 3
    tail = [500 + i for i in range(2 * BS)]
    prompt = public + tail + [9]
    hit = kv.lookup("tenant-a", prompt)
    assert hit.blocks() == pinned and hit.num_tokens == 3 * BS  # B's first visit hits the public blocks
    _cache(kv, "a", prompt, "tenant-a")
    assert kv.lookup("tenant-a", prompt).num_tokens == 5 * BS  # A's tail cached
    hit = kv.lookup("tenant-b", prompt)
    assert (hit.blocks(), hit.num_tokens) == (pinned, 3 * BS)  # B: public only
    kv.check_integrity()


def test_pinned_public_blocks_survive_any_flood() -> None:
    kv = KVCacheManager(num_blocks=12, block_size=BS)
    public = list(range(2 * BS))
    pinned = _pin_public(kv, public)
    for i in range(20):
        _cache(kv, f"f{i}", _prompt(100 + i, 4), "flooder")
    assert kv.lookup("anyone", [*public, 1]).blocks() == pinned
    assert kv.allocate("huge", 11 * BS, [], "x") is None  # pinned blocks are never handed out
    kv.check_integrity()


def test_a_private_prompt_never_hits_the_public_chain() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    prompt = _prompt(3, 2)
    _cache(kv, "a", prompt, "tenant-a")
    assert kv.lookup(PUBLIC_NAMESPACE, prompt).num_tokens == 0  # tenants' blocks never become public
    assert kv.lookup("tenant-a", prompt).num_tokens == 2 * BS


def test_salts_are_length_prefixed_and_keyed() -> None:
    assert encode_fields("a/b", "c") != encode_fields("a", "b/c")
    assert derive_salt(b"k", "a/b", "c") != derive_salt(b"k", "a", "b/c")
    assert tenant_salt(b"k1", "acme") != tenant_salt(b"k2", "acme")
    assert tenant_salt(b"k1", "acme") == tenant_salt(b"k1", "acme") and len(tenant_salt(b"k", "x")) == 64

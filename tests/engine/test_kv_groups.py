"""KV groups in the cache manager, torch-free: windowed groups give back what their window left, the prefix
cache serves a hit only where every group has the blocks it needs, and the books balance throughout."""

from __future__ import annotations

from edgeinfer.engine.kv_cache import NULL_BLOCK, KVCacheManager, plan_groups
from edgeinfer.engine.kv_cache.hashing import PUBLIC_NAMESPACE
from edgeinfer.engine.kv_cache.prefix import group_key

BS, WINDOW = 4, 8
GEMMA3_270M = [None if (i + 1) % 6 == 0 else 512 for i in range(18)]


def _hybrid(num_blocks: int = 64) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, windows=(None, WINDOW))


def _compute(kv: KVCacheManager, rid: str, tokens: list[int], chunk: int, namespace: str = "") -> None:
    """A request prefilled `chunk` tokens a step, as the scheduler drives the manager."""
    assert kv.allocate(rid, min(chunk, len(tokens)), namespace=namespace) is not None
    for done in range(chunk, len(tokens) + chunk, chunk):
        kv.commit(rid, tokens, min(done, len(tokens)))
        if done < len(tokens):
            assert kv.allocate(rid, min(done + chunk, len(tokens))) is not None
        kv.check_integrity()


def test_groups_follow_the_layers_windows():
    gemma = plan_groups(GEMMA3_270M, 32768)
    assert gemma.slots == 3 and gemma.windows == (512,) * 5 + (None,)
    assert gemma.groups[-1].layers == (5, 11, 17)
    assert {gemma.slot_of(layer) for layer in range(18)} == {0, 1, 2}
    # a window the context never outgrows frees nothing: one group, as without windows
    assert plan_groups(GEMMA3_270M, 512).windows == (None,)
    assert plan_groups(GEMMA3_270M, 32768, hybrid=False).windows == (None,)
    assert plan_groups([None] * 4, 100).slots == 4
    uneven = plan_groups([8, 8, 8, None, None], 100)  # 3 windowed layers in groups of 2: one slot unused
    assert uneven.slots == 2 and [g.layers for g in uneven.groups] == [(0, 1), (2,), (3, 4)]


def test_a_windowed_group_holds_its_window_while_the_full_group_grows():
    kv = _hybrid()
    tokens = list(range(200))
    _compute(kv, "r", tokens, chunk=5)
    full, windowed = kv.tables["r"]
    assert len(full) == len(windowed) == 50 and NULL_BLOCK not in full
    live = [b for b in windowed if b != NULL_BLOCK]
    assert live == windowed[-len(live) :] and len(live) <= -(-WINDOW // BS) + 1
    assert kv.in_use(1) == len(live) and kv.in_use(0) == 50
    kv.free("r")
    kv.check_integrity()
    assert kv.pool.num_free == kv.pool.num_blocks


def test_peak_blocks_bound_what_a_request_holds():
    kv = _hybrid()
    tokens = list(range(123))
    peak = 0
    assert kv.allocate("r", 16) is not None
    for done in range(16, 123 + 16, 16):
        peak = max(peak, kv.num_held("r"))
        kv.commit("r", tokens, min(done, 123))
        kv.allocate("r", min(done + 16, 123))
    assert peak <= kv.peak_blocks(123, 16) < 2 * 31
    kv.free("r")


def test_a_hit_needs_only_the_window_before_it_in_a_windowed_group():
    kv = _hybrid()
    tokens = list(range(41))
    _compute(kv, "a", tokens, chunk=41)
    kv.free("a")
    hit = kv.lookup("", tokens)
    assert hit.num_tokens == 40
    full, windowed = hit.tables
    assert len(full) == len(windowed) == 10
    # a query at 40 sees keys 33.., which lie in blocks 8 and 9
    assert windowed[:8] == [NULL_BLOCK] * 8 and NULL_BLOCK not in windowed[8:]
    cached = [kv.pool.lookup(group_key(h, 1)) for h in hit.hashes]  # every block of it is still cached
    assert cached[8:] == windowed[8:]
    # the windowed group's early blocks may go: the hit stays whole
    for h in hit.hashes[:7]:
        kv.pool.forget(kv.pool.lookup(group_key(h, 1)))
    assert kv.lookup("", tokens).num_tokens == 40
    # its last block gone, the hit is cut back to where the group still has its window's blocks: at 36,
    # blocks 7 and 8
    kv.pool.forget(windowed[9])
    hit = kv.lookup("", tokens)
    assert hit.num_tokens == 36 and hit.tables[1] == [NULL_BLOCK] * 7 + cached[7:9]
    kv.pool.forget(cached[7])
    assert kv.lookup("", tokens).num_tokens == 0  # none of blocks 0-7 left in the windowed group
    assert kv.allocate("b", 41, hit) is not None
    kv.check_integrity()
    kv.commit("b", tokens, 41)
    kv.free("b")
    kv.check_integrity()


def test_a_full_group_miss_ends_the_hit():
    kv = _hybrid()
    tokens = list(range(41))
    _compute(kv, "a", tokens, chunk=41)
    kv.free("a")
    full = kv.lookup("", tokens).tables[0]
    kv.pool.forget(full[3])
    assert kv.lookup("", tokens).num_tokens == 12


def test_trim_and_preemption_give_back_every_group():
    kv = _hybrid(num_blocks=24)
    tokens = list(range(60))
    _compute(kv, "r", tokens, chunk=12)
    assert kv.allocate("r", 60 + 5) is not None  # the next token and four drafts: a new block in each group
    kv.trim("r", 61)
    assert [len(t) for t in kv.tables["r"]] == [16, 16]
    kv.check_integrity()
    kv.free("r")  # a preemption frees as a finish does
    kv.check_integrity()
    assert kv.pool.num_free == kv.pool.num_blocks


def test_a_pool_too_small_for_all_of_a_long_sequence_holds_its_window():
    """20 blocks: a 60-token sequence needs 15 in the full group, so without the window's release (another
    15 in the windowed group) it would not fit."""
    kv = _hybrid(num_blocks=20)
    _compute(kv, "r", list(range(60)), chunk=8)
    assert kv.num_held("r") <= 15 + 4
    kv.free("r")
    kv.check_integrity()


def test_a_pinned_public_prefix_serves_every_tenant_through_any_flood():
    """Pinning a public prefix pins what each group needs of it (its windowed groups: the last window's
    blocks); tenants hit it whole however many of their own blocks a flood evicts."""
    kv = _hybrid(num_blocks=40)
    public = list(range(10 * BS))
    _compute(kv, "public", public, chunk=BS, namespace=PUBLIC_NAMESPACE)
    kv.free("public")
    hit = kv.lookup(PUBLIC_NAMESPACE, [*public, 0])
    assert kv.pin(hit) == 10 + 2  # every global block, the windowed group's last two
    for i in range(12):  # each flood request needs most of the pool: every unpinned cached block goes
        flood = [10_000 * (i + 1) + t for t in range(50)]
        kv.allocate(f"f{i}", 50, kv.lookup("flooder", flood), "flooder", "flooder")
        kv.commit(f"f{i}", flood, 50)
        kv.free(f"f{i}")
    hit = kv.lookup("tenant-a", [*public, 7, 8])
    assert hit.num_tokens == 10 * BS and hit.num_public == 10
    assert kv.allocate("a", 10 * BS + 2, hit, "tenant-a", "tenant-a") is not None
    kv.check_integrity()
    kv.free("a")

"""The routing policy over hand-made fleet snapshots (no processes, no I/O)."""

from __future__ import annotations

import argparse
import random
from collections import Counter

import pytest

from edgeinfer.router.cli import add_arguments, build_config
from edgeinfer.router.geo import Location, NetworkModel, RttTable, great_circle_km
from edgeinfer.router.policy import (
    ModelCosts,
    NodeState,
    PolicyConfig,
    RequestFeatures,
    Snapshot,
    Strategy,
    decide,
    estimate,
    is_busy,
    rendezvous_order,
)

LOCATIONS = [Location("FRA", 50.03, 8.57), Location("AMS", 52.31, 4.76), Location("SIN", 1.36, 103.99)]
RTT = RttTable(LOCATIONS)
NOW = 100.0
CONFIG = PolicyConfig()


def node(node_id: str, location: str, *, warm: bool = True, **kw: object) -> NodeState:
    fields: dict[str, object] = {"capacity": 4, "ts": NOW, **kw}
    models = frozenset({"m"})
    return NodeState(
        node_id=node_id,
        location=location,
        models_available=models,
        models_warm=models if warm else frozenset(),
        **fields,
    )


def req(location: str = "FRA", **kw: object) -> RequestFeatures:
    return RequestFeatures(
        model="m", prompt_tokens=kw.pop("prompt_tokens", 100), client_location=location, **kw
    )  # type: ignore[arg-type]


def route(nodes: list[NodeState], request: RequestFeatures | None = None, **kw: object):
    return decide(Snapshot(nodes, RTT, NOW), request or req(), random.Random(0), **kw)  # type: ignore[arg-type]


def test_great_circle_and_rtt_are_plausible():
    fra, ams, sin = LOCATIONS
    assert 350 < great_circle_km(fra, ams) < 400
    assert 10_000 < great_circle_km(fra, sin) < 10_500
    assert RTT("FRA", "AMS") == RTT("AMS", "FRA") < RTT("FRA", "SIN")
    assert RTT.nearest_first("FRA") == ["FRA", "AMS", "SIN"]
    # The router's model and the simulator's are one: a location's own clients pay the last mile only.
    assert RTT("FRA", "FRA") == pytest.approx(NetworkModel().last_mile_ms / 1000)
    with pytest.raises(KeyError):
        RTT("FRA", "XXX")


def test_rtt_matrix_overrides_geometry():
    # Above the last mile a client pays even within its own location, below the distance to AMS.
    table = RttTable(LOCATIONS, {("FRA", "SIN"): 0.006})
    assert table("SIN", "FRA") == 0.006
    assert table.nearest_first("FRA") == ["FRA", "SIN", "AMS"]
    with pytest.raises(ValueError, match="unknown location"):
        RttTable(LOCATIONS, {("FRA", "NYC"): 0.1})


def test_nearest_warm_location_wins():
    decision = route([node("sin", "SIN"), node("ams", "AMS"), node("fra", "FRA")])
    assert decision.kind == "route"
    assert [c.node_id for c in decision.ranked] == ["fra", "ams", "sin"]
    assert not decision.spilled


def test_cold_nearby_loses_to_warm_neighbour_but_beats_far_warm():
    cold_fra, warm_ams, warm_sin = node("fra", "FRA", warm=False), node("ams", "AMS"), node("sin", "SIN")
    assert route([cold_fra, warm_ams]).best.node_id == "ams"
    # 5 s cold load vs ~0.15 s RTT: the far location still wins; with a cheap load the local one does.
    assert route([cold_fra, warm_sin]).best.node_id == "sin"
    cheap = PolicyConfig(cold_load_s=0.05)
    best = route([cold_fra, warm_sin], config=cheap).best
    assert best.node_id == "fra" and best.cold_s == 0.05


def test_loading_counts_half_the_cold_penalty():
    loading = NodeState(
        node_id="fra",
        location="FRA",
        models_available=frozenset({"m"}),
        models_loading=frozenset({"m"}),
        capacity=4,
        ts=NOW,
    )
    assert estimate(Snapshot([loading], RTT, NOW), req(), loading, CONFIG).cold_s == CONFIG.cold_load_s / 2


def test_queue_wait_spills_to_next_location_and_comes_back():
    ams = node("ams", "AMS")
    queued = node("fra", "FRA", running=4, queue_depth=3)  # 4 slots busy, 3 waiting
    decision = route([queued, ams])
    assert decision.best.node_id == "ams" and decision.spilled
    # 4 running x 10 ms + 3 queued x 50 ms + slot wait (7 + 1 - 4) / 4 x 1 s
    assert decision.ranked[1].queue_wait_s == pytest.approx(0.04 + 0.15 + 1.0)
    assert not route([node("fra", "FRA"), ams]).spilled


def test_every_running_request_adds_queue_wait():
    # At equal RTT the node with more running requests ranks lower, long before its slots are full.
    busier, idler = node("a", "FRA", running=2, capacity=16), node("b", "FRA", running=1, capacity=16)
    ranked = route([busier, idler, node("c", "AMS", running=3, capacity=16)]).ranked
    assert [c.node_id for c in ranked] == ["b", "c", "a"]
    waits = {c.node_id: c.queue_wait_s for c in ranked}
    assert waits["b"] == pytest.approx(CONFIG.wait_per_running_s)
    assert waits["a"] == pytest.approx(2 * CONFIG.wait_per_running_s)
    # Two FRA nodes, same RTT: estimate ranks the busier one behind.
    snap = Snapshot([busier, idler], RTT, NOW)
    idle_ttft = estimate(snap, req(), idler, CONFIG).expected_ttft_s
    assert idle_ttft < estimate(snap, req(), busier, CONFIG).expected_ttft_s
    # A location whose node runs more requests loses to an idle one a few ms farther away; without the
    # per-running term (slots still free) it would not.
    loaded = [node("fra", "FRA", running=3), node("ams", "AMS")]
    assert route(loaded).best.node_id == "ams"
    assert route(loaded, config=PolicyConfig(wait_per_running_s=0.0)).best.node_id == "fra"


def test_per_model_costs_bigger_model_cold_load_costs_more():
    costs = {"small": ModelCosts(cold_load_s=0.05), "big": ModelCosts(cold_load_s=20.0)}
    config = PolicyConfig(models=costs)
    both = frozenset({"small", "big"})
    cold_fra = NodeState(node_id="fra", location="FRA", models_available=both, capacity=4, ts=NOW)
    warm_sin = NodeState(
        node_id="sin", location="SIN", models_available=both, models_warm=both, capacity=4, ts=NOW
    )
    snap = Snapshot([cold_fra, warm_sin], RTT, NOW)
    small = RequestFeatures(model="small", prompt_tokens=100, client_location="FRA")
    big = RequestFeatures(model="big", prompt_tokens=100, client_location="FRA")
    assert estimate(snap, big, cold_fra, config).cold_s > estimate(snap, small, cold_fra, config).cold_s
    # Loading the small model nearby beats the far warm copy; for the big one, spilling far wins.
    assert decide(snap, small, random.Random(0), config).best.node_id == "fra"
    assert decide(snap, big, random.Random(0), config).best.node_id == "sin"
    # A model the map does not list falls back to the global constants.
    assert config.costs("other").cold_load_s == CONFIG.cold_load_s


def test_cached_prefix_shortens_prefill():
    fra, ams = node("fra", "FRA"), node("ams", "AMS")
    long = req(prompt_tokens=4000)
    assert route([fra, ams], long).best.node_id == "fra"
    cached = req(prompt_tokens=4000, cached_tokens={"ams": 3900})
    best = route([fra, ams], cached).best
    assert best.node_id == "ams" and best.prefill_s == pytest.approx(100 / CONFIG.prefill_tokens_per_s)


def test_busy_thresholds_and_staleness_exclude_then_reject():
    over_queue = node("a", "FRA", queue_depth=CONFIG.busy_queue_depth)
    over_kv = node("b", "FRA", kv_usage=0.99)
    stale = node("c", "AMS", ts=NOW - CONFIG.stale_after_s - 0.01)
    broken = node("e", "FRA", available=False)
    for n in (over_queue, over_kv, stale, broken):
        assert is_busy(n, NOW, CONFIG)
    decision = route([over_queue, over_kv, stale, broken])
    assert decision.kind == "reject" and decision.retry_after_s > 0 and not decision.ranked
    assert route([over_queue, over_kv, stale, node("d", "SIN")]).best.node_id == "d"


def test_silent_nodes_drop_out_and_unknown_models_are_named():
    gone = node("a", "FRA", ts=NOW - CONFIG.drop_after_s - 1)
    assert route([gone]).kind == "unknown_model"
    other = NodeState(node_id="x", location="FRA", models_available=frozenset({"other"}), ts=NOW)
    assert route([other]).kind == "unknown_model"


def test_two_choices_prefers_the_less_loaded():
    light, heavy = node("light", "FRA", running=0), node("heavy", "FRA", running=3)
    picks = Counter(route([light, heavy]).best.node_id for _ in range(20))
    assert picks == {"light": 20}


def test_two_choices_spreads_over_equal_nodes_and_is_seedable():
    nodes = [node(f"n{i}", "FRA") for i in range(4)]
    snap = Snapshot(nodes, RTT, NOW)
    rng = random.Random(7)
    picks = Counter(decide(snap, req(), rng).best.node_id for _ in range(400))
    assert set(picks) == {"n0", "n1", "n2", "n3"} and min(picks.values()) > 50
    first, second = random.Random(3), random.Random(3)
    runs = [[decide(snap, req(), rng).best.node_id for _ in range(10)] for rng in (first, second)]
    assert runs[0] == runs[1]


def test_affinity_sticks_with_headroom_and_moves_without():
    ids = [f"n{i}" for i in range(3)]
    owner = rendezvous_order("t/session-1", ids)[0]
    nodes = [node(i, "FRA", running=3 if i == owner else 0) for i in ids]  # owner: 1 slot left
    request = req(affinity_key="session-1", tenant="t")
    assert {route(nodes, request).best.node_id for _ in range(10)} == {owner}
    full = [node(i, "FRA", running=4, queue_depth=2) if i == owner else node(i, "FRA") for i in ids]
    moved = route(full, request).best.node_id
    assert moved != owner and moved == rendezvous_order("t/session-1", ids)[1]


def test_affinity_key_is_namespaced_by_tenant():
    ids = [f"n{i}" for i in range(8)]
    owners = {rendezvous_order(f"{t}/same-key", ids)[0] for t in ("a", "b", "c", "d", "e", "f")}
    assert len(owners) > 1


def test_rendezvous_moves_only_the_removed_nodes_keys():
    ids = [f"n{i}" for i in range(5)]
    keys = [f"k{i}" for i in range(300)]
    before = {k: rendezvous_order(k, ids)[0] for k in keys}
    after = {k: rendezvous_order(k, ids[:-1])[0] for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == "n4" for k in moved)


def test_baseline_strategies():
    fra = node("fra", "FRA", running=4, queue_depth=3)
    ams, sin = node("ams", "AMS", running=1), node("sin", "SIN")
    assert route([fra, ams, sin], strategy="nearest").best.node_id == "fra"
    assert route([fra, ams, sin], strategy=Strategy.LEAST_LOADED).best.node_id == "sin"
    assert route([fra, ams, sin]).best.node_id == "ams"
    with pytest.raises(ValueError, match="unknown routing strategy"):
        route([fra], strategy="random")


def test_ranked_lists_every_usable_node_once_for_retries():
    nodes = [node(f"{loc}{i}", loc) for loc in ("FRA", "AMS") for i in range(3)]
    ranked = [c.node_id for c in route(nodes).ranked]
    assert sorted(ranked) == sorted(n.node_id for n in nodes)
    assert ranked[0].startswith("FRA") and ranked[1].startswith("AMS")


def test_router_loads_no_node_engine_pool_or_torch():
    """The router talks to nodes over HTTP only; it shares the torch-free `api` room with them (schemas,
    request validation, errors, tenants) so that its answers match a node's."""
    import subprocess
    import sys

    code = (
        "import sys, edgeinfer.router.app, edgeinfer.router.cli, edgeinfer.fleet.up; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch' or "
        "m.startswith(('edgeinfer.engine', 'edgeinfer.pool', 'edgeinfer.node'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_router_flags_set_the_wait_constants():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--fleet", "f.toml", "--location", "fra", "--wait-per-running-s", "0.02"])
    policy = build_config(args).policy
    assert policy.wait_per_running_s == 0.02
    assert policy.wait_per_queued_s == CONFIG.wait_per_queued_s


def test_a_request_naming_an_adapter_goes_where_it_is_loaded():
    """Within a location, a warm node holding the adapter is picked over warm ones without it (whatever
    the two random choices draw), and the estimate charges the adapter's load elsewhere."""
    hot = node("fra-hot", "FRA", running=2, adapters_warm=frozenset({"t.support"}))
    cold = node("fra-cold", "FRA")
    for seed in range(20):
        d = decide(Snapshot([hot, cold], RTT, NOW), req(adapter="t.support"), random.Random(seed))
        assert d.ranked[0].node_id == "fra-hot"
    snapshot = Snapshot([hot, cold], RTT, NOW)
    plain = {decide(snapshot, req(), random.Random(s)).ranked[0].node_id for s in range(20)}
    assert plain == {"fra-cold"}  # without an adapter the less loaded node wins, as before
    costs = CONFIG.costs("m")
    with_adapter = estimate(Snapshot([cold], RTT, NOW), req(adapter="t.support"), cold, CONFIG, costs)
    without = estimate(Snapshot([cold], RTT, NOW), req(), cold, CONFIG, costs)
    assert with_adapter.expected_ttft_s - without.expected_ttft_s == pytest.approx(CONFIG.adapter_load_s)

"""The warm-pool placement rule over hand-made snapshots."""

from __future__ import annotations

from edgeinfer.router.geo import Location, RttTable
from edgeinfer.router.placement import Demand, PlacementConfig, plan
from edgeinfer.router.policy import NodeState, PolicyConfig, Snapshot

RTT = RttTable([Location("FRA", 50.03, 8.57), Location("AMS", 52.31, 4.76), Location("SIN", 1.36, 103.99)])
POLICY = PolicyConfig()


def node(
    node_id: str, location: str, warm: tuple[str, ...] = (), loading: tuple[str, ...] = (), **kw
) -> NodeState:
    return NodeState(
        node_id=node_id,
        location=location,
        models_available=frozenset({"m"}),
        models_warm=frozenset(warm),
        models_loading=frozenset(loading),
        capacity=4,
        ts=10.0,
        **kw,
    )


def run(nodes: list[NodeState], count: int = 5, near_ms: float = 20.0, location: str = "FRA"):
    config = PlacementConfig(min_requests=5, near_rtt_s=near_ms / 1000)
    return plan(Snapshot(nodes, RTT, 10.0), {(location, "m"): count}, config, POLICY)


def test_far_demand_loads_the_model_at_the_nearest_location():
    nodes = [node("fra-1", "FRA", queue_depth=1), node("fra-2", "FRA"), node("sin-1", "SIN", warm=("m",))]
    assert run(nodes) == [("fra-2", "m")]  # the less loaded node of the nearest location
    assert run(nodes, count=4) == []  # not sustained enough


def test_a_warm_or_loading_copy_nearby_is_enough():
    assert run([node("fra-1", "FRA"), node("ams-1", "AMS", warm=("m",))]) == []  # 12.3 ms away
    assert run([node("fra-1", "FRA"), node("ams-1", "AMS", warm=("m",))], near_ms=5.0) == [("fra-1", "m")]
    assert run([node("fra-1", "FRA", loading=("m",)), node("sin-1", "SIN", warm=("m",))]) == []


def test_busy_or_stale_nodes_are_not_asked():
    busy = node("fra-1", "FRA", queue_depth=POLICY.busy_queue_depth)
    assert run([busy, node("ams-1", "AMS"), node("sin-1", "SIN", warm=("m",))]) == [("ams-1", "m")]
    stale = NodeState(
        node_id="fra-1", location="FRA", models_available=frozenset({"m"}), ts=10.0 - POLICY.stale_after_s - 1
    )
    assert run([stale, node("sin-1", "SIN", warm=("m",))]) == []


def test_demand_window_slides():
    now = [0.0]
    demand = Demand(10.0, clock=lambda: now[0])
    for t in (0.0, 1.0, 9.0):
        now[0] = t
        demand.add("FRA", "m")
    assert demand.counts() == {("FRA", "m"): 3}
    now[0] = 10.5
    assert demand.counts() == {("FRA", "m"): 2}
    now[0] = 11.5
    assert demand.counts() == {("FRA", "m"): 1}
    now[0] = 20.0
    assert demand.counts() == {}

"""The router's fleet state: what it sent since a node's last status counts as queued there."""

from __future__ import annotations

import random
from collections import Counter

from edgeinfer.router.fleet_file import parse_fleet
from edgeinfer.router.policy import PolicyConfig, RequestFeatures, decide
from edgeinfer.router.state import FleetState
from edgeinfer.types.status import NodeStatus

FLEET = {
    "locations": [
        {
            "code": "FRA",
            "lat": 50.03,
            "lon": 8.57,
            "nodes": [{"id": "a", "url": "http://127.0.0.1:1"}, {"id": "b", "url": "http://127.0.0.1:2"}],
        }
    ]
}
REQUEST = RequestFeatures(model="m", prompt_tokens=100, client_location="FRA")


def _state() -> FleetState:
    state = FleetState(parse_fleet(FLEET), clock=lambda: 10.0)
    for node_id in ("a", "b"):
        state.update(NodeStatus(node_id, "FRA", ("m",), ("m",), capacity=2))
    return state


def _send(state: FleetState, config: PolicyConfig, rng: random.Random) -> str | None:
    """One decision, and the count the forwarder keeps for the node it sends to."""
    decision = decide(state.snapshot(), REQUEST, rng, config)
    if decision.best is None:
        return None
    state.nodes[decision.best.node_id].sent()
    return decision.best.node_id


def test_requests_sent_between_statuses_spread_and_count_towards_busy():
    state, rng = _state(), random.Random(0)
    # No new status arrives: without the count every request would see two idle nodes.
    sent = [_send(state, PolicyConfig(), rng) for _ in range(6)]
    assert Counter(sent) == {"a": 3, "b": 3}
    # Three sent to each: two fill its slots, one waits.
    assert [(n.running, n.queue_depth) for n in state.snapshot().nodes] == [(2, 1), (2, 1)]
    # So with a busy threshold of one waiting request both are busy until a node reports again.
    assert decide(state.snapshot(), REQUEST, rng, PolicyConfig(busy_queue_depth=1)).best is None


def test_a_new_status_replaces_the_count():
    state, rng = _state(), random.Random(0)
    for _ in range(4):
        _send(state, PolicyConfig(), rng)
    state.update(NodeStatus("a", "FRA", ("m",), ("m",), capacity=2, running=2))
    depths = {n.node_id: (n.running, n.queue_depth) for n in state.snapshot().nodes}
    assert depths == {"a": (2, 0), "b": (2, 0)}


def test_a_request_that_ends_before_the_next_status_leaves_the_count():
    state = _state()
    view = state.nodes["a"]
    # two short requests one after the other, both over before "a" reports again: "a" is idle
    for _ in range(2):
        view.finished(view.sent())
    assert [(n.running, n.queue_depth) for n in state.snapshot().nodes if n.node_id == "a"] == [(0, 0)]
    # one still running when the next status comes: that status counts it, so its end changes nothing
    counted = view.sent()
    later = view.sent()
    state.update(NodeStatus("a", "FRA", ("m",), ("m",), capacity=2, running=1))
    view.finished(counted)
    assert view.sent_since_status == 0
    # a request sent after that status is the router's to count until it ends
    after = view.sent()
    view.finished(later)  # counted against the old status: not this one's
    assert view.sent_since_status == 1
    view.finished(after)
    assert view.sent_since_status == 0

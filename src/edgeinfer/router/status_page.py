"""GET /status: the fleet as this router sees it (plain HTML + a small script polling /status.json)."""

from __future__ import annotations

import functools
import time
from importlib import resources
from typing import Any


@functools.cache
def page() -> bytes:
    return resources.files("edgeinfer.router").joinpath("static/status.html").read_bytes()


def status(service: Any) -> dict[str, Any]:
    """What /status.json answers: every location with its nodes' state, and the recent spill-overs."""
    state = service.state
    now = state.clock()
    policy = service.config.policy
    locations = []
    for loc in state.fleet.locations:
        nodes = [
            _node(view, now, policy.stale_after_s)
            for view in state.nodes.values()
            if view.entry.location == loc.code
        ]
        locations.append({"code": loc.code, "lat": loc.lat, "lon": loc.lon, "nodes": nodes})
    return {
        "router_location": service.config.location,
        "time": time.time(),
        "locations": locations,
        "recent_spillovers": list(service.recent_spills),
    }


def _node(view: Any, now: float, stale_after_s: float) -> dict[str, Any]:
    status = view.status
    age = None if status is None else round(now - view.received_at, 3)
    base = {"id": view.entry.node_id, "breaker": view.breaker.state, "age_s": age}
    if status is None:
        return {**base, "state": "never reported"}
    return {
        **base,
        "state": "stale" if age is not None and age > stale_after_s else "live",
        "models_warm": sorted(status.models_warm),
        "models_loading": sorted(status.models_loading),
        "queue_depth": status.queue_depth,
        "running": status.running,
        "capacity": status.capacity,
        "kv_usage": status.kv_usage,
    }

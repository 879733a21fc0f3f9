"""Routing policies in the simulator: the router's own `policy.decide` and three baselines.

- `router`: `edgeinfer.router.policy.decide` (`Strategy.TTFT`), imported, never copied. It sees a snapshot
  of the nodes in the `candidate_locations` locations nearest the client (a regional router's view; ranking
  every node of the fleet per request would dominate the run time and the far ones never win), live state
  (no staleness), the session's affinity key, and the prefix the session's last node holds. It returns a
  ranked list; the request goes to the first node that accepts it, as the router retries down the list.
- `nearest`: `decide(..., strategy=Strategy.NEAREST)` from the same module: the nearest location with the
  model warm.
- `least-loaded`: the least loaded node (in flight per slot) in the whole fleet that is not saturated, warm
  ones before cold ones, ignoring distance. Written here over numpy arrays because the module's version
  ranks every node per request.
- `round-robin`: the next node in a fleet-wide cycle among those with the model warm.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from edgeinfer.fleet.sim_scenario import SimPolicy
from edgeinfer.router import policy as router_policy
from edgeinfer.router.policy import DecisionKind, Strategy

if TYPE_CHECKING:
    from edgeinfer.fleet.sim_fleet import SimFleet
    from edgeinfer.fleet.sim_node import Node, SimRequest


class RouterPolicy:
    """Calls the router's policy module; `decide` is looked up on the module at each call (no copy)."""

    module = router_policy

    def __init__(self, fleet: SimFleet, strategy: Strategy = Strategy.TTFT) -> None:
        self.fleet, self.strategy = fleet, strategy
        # The router retries down its ranked list on 429; the nearest-only baseline does not spill.
        self.retries = strategy is Strategy.TTFT
        self.rng = random.Random(fleet.scenario.seed)
        self.config = fleet.policy_config()
        self.last_node: dict[int, Node] = {}  # session -> node of its previous turn
        self.calls = 0

    def choose(self, req: SimRequest, city: int) -> Sequence[Node]:
        fleet = self.fleet
        states = [fleet.node_state(n) for n in fleet.candidates[city]]
        snapshot = router_policy.Snapshot(nodes=states, rtt=fleet.rtt_by_code, now=fleet.env.now)
        session = req.prefix_key if req.prefix_key > 0 else None
        prev = self.last_node.get(session) if session else None
        features = router_policy.RequestFeatures(
            model=fleet.model_names[req.model],
            prompt_tokens=req.prompt,
            client_location=fleet.locations[city].code,
            affinity_key=str(session) if session else None,
            cached_tokens={prev.name: req.prefix_len} if prev is not None else {},
        )
        self.calls += 1
        decision = self.module.decide(snapshot, features, self.rng, self.config, self.strategy)
        if decision.kind is not DecisionKind.ROUTE:
            return ()
        ranked = [fleet.node_by_name[c.node_id] for c in decision.ranked]
        if session and ranked:
            self.last_node[session] = ranked[0]
        return ranked


class LeastLoaded:
    retries = False

    def __init__(self, fleet: SimFleet) -> None:
        self.fleet = fleet

    def choose(self, req: SimRequest, city: int) -> Sequence[Node]:
        board = self.fleet.board
        # As the module's least-loaded baseline: busy nodes out, warm before cold, then in-flight per slot.
        load = board.in_flight / board.capacity + np.where(board.warm[req.model], 0.0, 1e6)
        load[board.saturated] = np.inf
        best = int(np.argmin(load))
        return () if np.isinf(load[best]) else (self.fleet.nodes[best],)


class RoundRobin:
    retries = False

    def __init__(self, fleet: SimFleet) -> None:
        self.fleet = fleet
        self.next: dict[int, int] = {}

    def choose(self, req: SimRequest, city: int) -> Sequence[Node]:
        nodes, warm = self.fleet.nodes, self.fleet.board.warm[req.model]
        start = self.next.get(req.model, 0)
        after = np.flatnonzero(warm[start:])
        if len(after):
            pick = start + int(after[0])
        else:
            before = np.flatnonzero(warm[:start])
            pick = int(before[0]) if len(before) else start % len(nodes)
        self.next[req.model] = (pick + 1) % len(nodes)
        return (nodes[pick],)


POLICIES: dict[SimPolicy, Callable[[SimFleet], RouterPolicy | LeastLoaded | RoundRobin]] = {
    SimPolicy.ROUTER: lambda fleet: RouterPolicy(fleet, Strategy.TTFT),
    SimPolicy.NEAREST: lambda fleet: RouterPolicy(fleet, Strategy.NEAREST),
    SimPolicy.LEAST_LOADED: LeastLoaded,
    SimPolicy.ROUND_ROBIN: RoundRobin,
}


def make_policy(name: str, fleet: SimFleet) -> RouterPolicy | LeastLoaded | RoundRobin:
    """The policy `name` (a SimPolicy or its name) over `fleet`."""
    try:
        policy = SimPolicy(name)
    except ValueError:
        raise ValueError(f"unknown policy {name!r}") from None
    return POLICIES[policy](fleet)

"""What the router knows of the fleet: each node's last status, when it arrived, and its breaker.

Statuses come from a source (NATS or HTTP polling, sources.py); ages are measured on the router's
monotonic clock from when a status *arrived*, so node clocks need not agree with the router's.

Between two statuses (a poll interval apart) a busy router forwards several requests, and every one of them
would see the same snapshot and pick the same cheapest node. So the router counts what it has sent to each
node since that node's last status and adds it to what the node said (into its free slots first, the rest as
queued); the next status, which counts them itself, starts the count again. A request that ends before that
status arrives is in no status at all, so it leaves the count when it ends: otherwise a few short requests in
a row would make an idle node look full until its next status (a session's owner would lose its affinity to
another node after a couple of short completions within one status interval).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from edgeinfer.router.breaker import CircuitBreaker
from edgeinfer.router.fleet_file import Fleet, NodeEntry
from edgeinfer.router.policy import NodeState, Snapshot
from edgeinfer.types.status import NodeStatus

logger = logging.getLogger("edgeinfer.router")


@dataclass
class NodeView:
    entry: NodeEntry
    breaker: CircuitBreaker
    status: NodeStatus | None = None
    received_at: float = float("-inf")
    sent_since_status: int = 0  # requests this router forwarded after `status` arrived, still running
    statuses: int = 0  # how many statuses arrived: which one a forwarded request was counted against

    def sent(self) -> int:
        """Count a request forwarded now; returns what `finished` takes when it ends."""
        self.sent_since_status += 1
        return self.statuses

    def finished(self, counted_against: int) -> None:
        """A forwarded request ended: if no status arrived since it was sent, no status counts it, and
        neither may the router any longer."""
        if counted_against == self.statuses and self.sent_since_status > 0:
            self.sent_since_status -= 1


class FleetState:
    def __init__(
        self,
        fleet: Fleet,
        breaker_factory: Callable[[], CircuitBreaker] = CircuitBreaker,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.fleet = fleet
        self.clock = clock
        self.nodes = {e.node_id: NodeView(e, breaker_factory()) for e in fleet.nodes}
        self._unknown_seen: set[str] = set()

    def update(self, status: NodeStatus) -> None:
        view = self.nodes.get(status.node_id)
        if view is None:
            if status.node_id not in self._unknown_seen:
                self._unknown_seen.add(status.node_id)
                logger.warning("ignoring status of node %r: not in the fleet file", status.node_id)
            return
        view.status = status
        view.received_at = self.clock()
        view.sent_since_status = 0
        view.statuses += 1

    def snapshot(self) -> Snapshot:
        """The policy's view: nodes that reported at least once, located where the fleet file says."""
        return Snapshot(
            [_state(view) for view in self.nodes.values() if view.status is not None],
            self.fleet.rtt,
            self.clock(),
        )

    def served_models(self, max_age_s: float) -> set[str]:
        return self._live_names(max_age_s, lambda status: status.models_available)

    def embedding_models(self, max_age_s: float) -> set[str]:
        """Models some live node serves as an embedding model (they answer `text` with vectors)."""
        return self._live_names(max_age_s, lambda status: status.models_embedding)

    def _live_names(self, max_age_s: float, names_of: Callable[[NodeStatus], tuple[str, ...]]) -> set[str]:
        now = self.clock()
        names: set[str] = set()
        for view in self.nodes.values():
            if view.status is not None and now - view.received_at <= max_age_s:
                names.update(names_of(view.status))
        return names


def _state(view: NodeView) -> NodeState:
    status = view.status
    assert status is not None
    starting = min(view.sent_since_status, max(0, status.capacity - status.running))
    return NodeState(
        node_id=status.node_id,
        location=view.entry.location,
        models_available=frozenset(status.models_available),
        models_warm=frozenset(status.models_warm),
        models_loading=frozenset(status.models_loading),
        adapters_warm=frozenset(status.adapters_warm),
        queue_depth=status.queue_depth + view.sent_since_status - starting,
        running=status.running + starting,
        kv_usage=status.kv_usage,
        capacity=status.capacity,
        ts=view.received_at,
        available=view.breaker.available(),
    )

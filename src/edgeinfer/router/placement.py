"""Warm pools across the fleet: ask a node to load a model where demand for it is sustained and no nearby
location has it warm. Eviction stays with each node's pool (idle models make room under its budget).

Rule, per (client location, model) with at least `min_requests` in the last `window_s`: if no node within
`near_rtt_s` of that location has the model warm or loading, the least loaded non-busy node of the nearest
location that serves it is asked to load it (POST /node/prefetch, signed like the tenant header), at most
once per `cooldown_s` per node and model. `plan` is pure; `PlacementLoop` runs it every `interval_s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import httpx

from edgeinfer.api import router_trust
from edgeinfer.router.policy import NodeState, PolicyConfig, Snapshot, is_busy
from edgeinfer.router.state import FleetState

logger = logging.getLogger("edgeinfer.router")


@dataclass(frozen=True)
class PlacementConfig:
    window_s: float = 10.0
    min_requests: int = 5
    near_rtt_s: float = 0.02  # a warm copy this close already serves the location well
    cooldown_s: float = 30.0
    interval_s: float = 1.0


class Demand:
    """Request arrival times per (client location, model) over a sliding window."""

    def __init__(self, window_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._window_s = window_s
        self._clock = clock
        self._arrivals: dict[tuple[str, str], deque[float]] = {}

    def add(self, location: str, model: str) -> None:
        self._arrivals.setdefault((location, model), deque()).append(self._clock())

    def counts(self) -> dict[tuple[str, str], int]:
        horizon = self._clock() - self._window_s
        for key, times in list(self._arrivals.items()):
            while times and times[0] < horizon:
                times.popleft()
            if not times:
                del self._arrivals[key]
        return {key: len(times) for key, times in self._arrivals.items()}


def plan(
    snapshot: Snapshot, demand: Mapping[tuple[str, str], int], config: PlacementConfig, policy: PolicyConfig
) -> list[tuple[str, str]]:
    """(node_id, model) pairs to load, for the rule in the module docstring."""
    live = [n for n in snapshot.nodes if snapshot.now - n.ts <= policy.stale_after_s and n.available]
    loads: list[tuple[str, str]] = []
    for (location, model), count in sorted(demand.items()):
        if count < config.min_requests:
            continue
        serving = [n for n in live if model in n.models_available]
        near = [n for n in serving if snapshot.rtt(location, n.location) <= config.near_rtt_s]
        if not serving or any(model in n.models_warm or model in n.models_loading for n in near):
            continue
        target = _nearest_free(snapshot, location, serving, policy)
        if target is not None and model not in target.models_warm and model not in target.models_loading:
            loads.append((target.node_id, model))
    return loads


def _nearest_free(
    snapshot: Snapshot, location: str, serving: list[NodeState], policy: PolicyConfig
) -> NodeState | None:
    free = [n for n in serving if not is_busy(n, snapshot.now, policy)]
    if not free:
        return None
    nearest = min(snapshot.rtt(location, n.location) for n in free)
    here = [n for n in free if snapshot.rtt(location, n.location) == nearest]
    return min(here, key=lambda n: (n.load, n.node_id))


class PlacementLoop:
    def __init__(
        self,
        state: FleetState,
        client: httpx.AsyncClient,
        secret: bytes,
        config: PlacementConfig,
        policy: PolicyConfig,
    ) -> None:
        self.state = state
        self.client = client
        self.secret = secret
        self.config = config
        self.policy = policy
        self.demand = Demand(config.window_s, state.clock)
        self._asked: dict[tuple[str, str], float] = {}
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="placement")

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.interval_s)
            for node_id, model in plan(self.state.snapshot(), self.demand.counts(), self.config, self.policy):
                now = self.state.clock()
                if now - self._asked.get((node_id, model), float("-inf")) >= self.config.cooldown_s:
                    self._asked[(node_id, model)] = now
                    await self._ask(node_id, model)

    async def _ask(self, node_id: str, model: str) -> None:
        url = self.state.nodes[node_id].entry.url + "/node/prefetch"
        headers = router_trust.signed_headers(self.secret, "router", time.time())
        try:
            response = await self.client.post(url, json={"model": model}, headers=headers, timeout=5.0)
            logger.info("placement: asked %s to load %s: %s", node_id, model, response.status_code)
        except httpx.HTTPError as exc:
            logger.warning("placement: asking %s to load %s failed: %r", node_id, model, exc)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

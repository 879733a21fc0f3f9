"""Routing policy: which node serves a request, pure over a snapshot of the fleet (no I/O, no torch).

The router and the fleet simulator both call it; its API is small and stable:

    snapshot = Snapshot(nodes=[NodeState(...), ...], rtt=RttTable(...), now=clock())
    decision = decide(snapshot, RequestFeatures(model, prompt_tokens, client_location, ...), rng, config)
    decision.kind       # ROUTE | REJECT (every candidate busy or stale) | UNKNOWN_MODEL
    decision.ranked     # Candidates, best first; the router tries them in order (retries go down the list)
    decision.spilled    # True when routed away from the nearest location that has the model warm

- `NodeState` is one node's last status (what `NodeStatus` carries), `ts` on the caller's clock, and
  `available` (False while the caller's circuit breaker for it is open: treated as busy).
- `rtt(a, b)` is any callable giving round-trip seconds between location codes (`geo.RttTable`).
- `rng` is a `random.Random` the caller seeds (power-of-two choices draw from it).
- `strategy` picks the ranking: `Strategy.TTFT` (this policy), `NEAREST` and `LEAST_LOADED` (baselines).

Policy (TTFT): candidates are the nodes that can serve the model, are not stale (status older than
`stale_after_s` counts as saturated) and are under the busy thresholds. Within each location one node
is chosen: the session's rendezvous-hash owner when the request has an affinity key and that node has
headroom under the load bound, else the less loaded of two random choices; warm nodes before cold
ones, and for a request naming a LoRA adapter, warm nodes holding it loaded before those. Locations are
then ranked by expected time to first token:
    RTT + predicted queue wait + prefill of the uncached prompt + cold-load penalty (model not warm,
    adapter not loaded),
the queue wait rising with every running and every queued request (a batch's step time grows with its size,
and queued prompts are prefilled first), plus a slot wait once the node's slots are full. The prefill,
cold-load and wait constants are per model (`PolicyConfig.models`), the global ones for models not listed.
Nodes silent longer than `drop_after_s` are ignored altogether (the caller may also drop them).
"""

from __future__ import annotations

import enum
import hashlib
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field


class Strategy(enum.StrEnum):
    """How candidates are ranked: expected time to first token, or one of the two baselines."""

    TTFT = "ttft"
    NEAREST = "nearest"
    LEAST_LOADED = "least-loaded"

    @classmethod
    def parse(cls, value: str) -> Strategy:
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"unknown routing strategy {value!r} (known: {', '.join(cls)})") from None


class DecisionKind(enum.StrEnum):
    ROUTE = "route"
    REJECT = "reject"  # every candidate is busy or stale
    UNKNOWN_MODEL = "unknown_model"  # no live node serves the model


@dataclass(frozen=True, kw_only=True)
class NodeState:
    """One node as last reported. `capacity`: requests it runs at once; `kv_usage` in [0, 1]."""

    node_id: str
    location: str
    models_available: frozenset[str]
    models_warm: frozenset[str] = frozenset()
    models_loading: frozenset[str] = frozenset()
    adapters_warm: frozenset[str] = frozenset()  # LoRA adapters loaded in its engines (by adapter key)
    queue_depth: int = 0
    running: int = 0
    kv_usage: float = 0.0
    capacity: int = 1
    ts: float = 0.0
    available: bool = True  # False: the caller's circuit breaker for this node is open (counts as busy)

    @property
    def in_flight(self) -> int:
        return self.running + self.queue_depth

    @property
    def load(self) -> float:
        """In-flight requests per slot (1.0: every slot busy, nothing queued)."""
        return self.in_flight / max(1, self.capacity)


@dataclass(frozen=True, kw_only=True)
class RequestFeatures:
    """What the router knows of a request before it is sent. `cached_tokens`: node_id → prompt tokens
    estimated to be in that node's prefix cache for this tenant (e.g. from the session's last turn).
    `cache_salt`: the tenant's cache salt, which scopes prefix-aware choices when set."""

    model: str
    prompt_tokens: int
    client_location: str
    affinity_key: str | None = None
    adapter: str | None = None  # the tenant's LoRA adapter it names (its adapter key), if any
    tenant: str = ""
    cached_tokens: Mapping[str, int] = field(default_factory=dict)
    cache_salt: str = ""


@dataclass(frozen=True, kw_only=True)
class ModelCosts:
    """One model's constants in the TTFT estimate (from a node profile: bench/fleet_profile.py)."""

    prefill_tokens_per_s: float = 2000.0
    cold_load_s: float = 5.0  # loading the model where it is not warm
    service_time_s: float = 1.0  # mean time a request holds a slot, for the slot-wait estimate
    # TTFT added by each request running on the node: the newcomer waits for the step in progress, whose
    # time grows with the batch (on a CPU node the dominant term, long before the slots are full).
    wait_per_running_s: float = 0.01
    wait_per_queued_s: float = 0.05  # by each request queued ahead: its prefill runs first


@dataclass(frozen=True, kw_only=True)
class PolicyConfig:
    """The policy's constants (docs/router.md explains how each was chosen)."""

    stale_after_s: float = 0.5  # 5 missed 10 Hz reports: treat as saturated
    drop_after_s: float = 3.0  # silent this long: the node is gone
    # A model's costs when `models` does not list it (ModelCosts explains each).
    prefill_tokens_per_s: float = 2000.0
    service_time_s: float = 1.0
    cold_load_s: float = 5.0
    wait_per_running_s: float = 0.01
    wait_per_queued_s: float = 0.05
    adapter_load_s: float = 0.1  # reading a LoRA adapter into an engine where it is not loaded
    models: Mapping[str, ModelCosts] = field(default_factory=dict)  # model name -> its costs
    busy_queue_depth: int = 16  # a node with this many waiting is over the threshold
    busy_kv_usage: float = 0.95
    affinity_load_bound: float = 1.25  # bounded-load factor c: owner kept while load <= c x mean
    retry_after_s: float = 1.0

    def costs(self, model: str) -> ModelCosts:
        listed = self.models.get(model)
        if listed is not None:
            return listed
        return ModelCosts(
            prefill_tokens_per_s=self.prefill_tokens_per_s,
            cold_load_s=self.cold_load_s,
            service_time_s=self.service_time_s,
            wait_per_running_s=self.wait_per_running_s,
            wait_per_queued_s=self.wait_per_queued_s,
        )


@dataclass(frozen=True)
class Snapshot:
    nodes: Sequence[NodeState]
    rtt: Callable[[str, str], float]
    now: float


@dataclass(frozen=True, kw_only=True)
class Candidate:
    node_id: str
    location: str
    expected_ttft_s: float
    rtt_s: float
    queue_wait_s: float
    prefill_s: float
    cold_s: float


@dataclass(frozen=True)
class Decision:
    kind: DecisionKind
    ranked: tuple[Candidate, ...] = ()
    spilled: bool = False
    retry_after_s: float = 0.0
    reason: str = ""

    @property
    def best(self) -> Candidate | None:
        return self.ranked[0] if self.ranked else None


def decide(
    snapshot: Snapshot,
    request: RequestFeatures,
    rng: random.Random,
    config: PolicyConfig | None = None,
    strategy: Strategy | str = Strategy.TTFT,
) -> Decision:
    """Rank the nodes for `request`; see the module docstring."""
    config = config or PolicyConfig()
    if not isinstance(strategy, Strategy):
        strategy = Strategy.parse(strategy)
    live = [n for n in snapshot.nodes if snapshot.now - n.ts <= config.drop_after_s]
    serving = [n for n in live if request.model in n.models_available]
    if not serving:
        return Decision(DecisionKind.UNKNOWN_MODEL, reason=f"no live node serves model {request.model!r}")
    if strategy is Strategy.NEAREST:
        # The baseline knows no load: saturated and stale nodes stay candidates (they answer 429).
        reachable = [n for n in serving if n.available]
        usable = [n for n in reachable if request.model in n.models_warm] or reachable
    else:
        usable = [n for n in serving if not is_busy(n, snapshot.now, config)]
    if not usable:
        return Decision(
            DecisionKind.REJECT,
            retry_after_s=config.retry_after_s,
            reason=f"all {len(serving)} nodes serving {request.model!r} are busy or stale",
        )
    ranked = _rank(snapshot, request, usable, rng, config, strategy)
    return Decision(
        DecisionKind.ROUTE, tuple(ranked), spilled=_spilled(snapshot, request, serving, ranked[0])
    )


def is_busy(node: NodeState, now: float, config: PolicyConfig) -> bool:
    """Over a busy threshold, unavailable, or its status too old to trust (counts as saturated)."""
    return (
        not node.available
        or now - node.ts > config.stale_after_s
        or node.queue_depth >= config.busy_queue_depth
        or node.kv_usage >= config.busy_kv_usage
    )


def estimate(
    snapshot: Snapshot,
    request: RequestFeatures,
    node: NodeState,
    config: PolicyConfig,
    costs: ModelCosts | None = None,
) -> Candidate:
    """Expected time to first token on `node`, by part (`costs`: config.costs(request.model), passed in
    by callers that estimate many nodes for one request)."""
    costs = costs or config.costs(request.model)
    rtt = snapshot.rtt(request.client_location, node.location)
    capacity = max(1, node.capacity)
    # Every request on the node slows the newcomer's first token; beyond the free slots it also waits for
    # running ones to finish, `capacity` at a time.
    excess = max(0, node.in_flight + 1 - capacity)
    wait = (
        node.running * costs.wait_per_running_s
        + node.queue_depth * costs.wait_per_queued_s
        + excess / capacity * costs.service_time_s
    )
    uncached = max(0, request.prompt_tokens - request.cached_tokens.get(node.node_id, 0))
    prefill = uncached / costs.prefill_tokens_per_s
    cold = 0.0
    if request.model not in node.models_warm:
        # A load already under way is, on average, half done.
        cold = costs.cold_load_s / 2 if request.model in node.models_loading else costs.cold_load_s
    if request.adapter is not None and request.adapter not in node.adapters_warm:
        cold += config.adapter_load_s
    return Candidate(
        node_id=node.node_id,
        location=node.location,
        expected_ttft_s=rtt + wait + prefill + cold,
        rtt_s=rtt,
        queue_wait_s=wait,
        prefill_s=prefill,
        cold_s=cold,
    )


def rendezvous_order(key: str, node_ids: Sequence[str]) -> list[str]:
    """Highest-random-weight order of `node_ids` for `key` (stable across processes and restarts)."""

    def weight(node_id: str) -> bytes:
        return hashlib.blake2b(f"{key}\x00{node_id}".encode(), digest_size=8).digest()

    return sorted(node_ids, key=weight, reverse=True)


def _rank(
    snapshot: Snapshot,
    request: RequestFeatures,
    usable: list[NodeState],
    rng: random.Random,
    config: PolicyConfig,
    strategy: Strategy,
) -> list[Candidate]:
    by_location: dict[str, list[NodeState]] = {}
    for node in sorted(usable, key=lambda n: n.node_id):
        by_location.setdefault(node.location, []).append(node)
    costs = config.costs(request.model)
    if strategy is Strategy.LEAST_LOADED:
        # The baseline ignores distance: the least loaded warm node anywhere, then the rest.
        order = sorted(usable, key=lambda n: (request.model not in n.models_warm, n.load, n.node_id))
        return [estimate(snapshot, request, n, config, costs) for n in order]
    firsts = [_pick_in_location(nodes, request, rng, config) for nodes in by_location.values()]
    if strategy is Strategy.NEAREST:
        key = lambda c: (c.rtt_s, c.location)  # noqa: E731
    else:
        key = lambda c: (c.expected_ttft_s, c.rtt_s, c.location)  # noqa: E731
    first_ids = {n.node_id for n in firsts}
    heads = sorted((estimate(snapshot, request, n, config, costs) for n in firsts), key=key)
    rest = sorted(
        (estimate(snapshot, request, n, config, costs) for n in usable if n.node_id not in first_ids),
        key=key,
    )
    return heads + rest


def _pick_in_location(
    nodes: list[NodeState], request: RequestFeatures, rng: random.Random, config: PolicyConfig
) -> NodeState:
    warm = [n for n in nodes if request.model in n.models_warm]
    # a node holding the request's adapter loaded before the other warm ones: no load, and the adapter's
    # requests share its steps there
    hot = [n for n in warm if request.adapter in n.adapters_warm] if request.adapter else []
    pool = hot or warm or nodes
    if request.affinity_key:
        owner = _affinity_owner(pool, request, config)
        if owner is not None:
            return owner
    if len(pool) == 1:
        return pool[0]
    a, b = rng.sample(pool, 2)
    return a if a.load <= b.load else b


def _affinity_owner(
    pool: list[NodeState], request: RequestFeatures, config: PolicyConfig
) -> NodeState | None:
    """The first node in the session's rendezvous order that has room: a free slot, or a load within
    `affinity_load_bound` x the location's mean (consistent hashing with bounded loads)."""
    total_slots = sum(max(1, n.capacity) for n in pool)
    mean_after = (sum(n.in_flight for n in pool) + 1) / total_slots
    bound = config.affinity_load_bound * mean_after
    by_id = {n.node_id: n for n in pool}
    scope = request.cache_salt or request.tenant  # a salt is hex: "/" never joins it ambiguously
    for node_id in rendezvous_order(f"{scope}/{request.affinity_key}", list(by_id)):
        node = by_id[node_id]
        after = (node.in_flight + 1) / max(1, node.capacity)
        if after <= 1.0 or after <= bound:
            return node
    return None


def _spilled(
    snapshot: Snapshot, request: RequestFeatures, serving: list[NodeState], chosen: Candidate
) -> bool:
    """Routed away from the nearest location that has the model warm (busy or not)."""
    warm = [n for n in serving if request.model in n.models_warm]
    if not warm:
        return False
    nearest = min(warm, key=lambda n: (snapshot.rtt(request.client_location, n.location), n.location))
    return chosen.location != nearest.location

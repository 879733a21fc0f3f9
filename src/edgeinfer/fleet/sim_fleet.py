"""The simulated fleet: locations, nodes with their initial placement, the RTT matrix, and the request feed.

Accelerators are apportioned to locations by population (largest remainder, at least `min_per_location`).
Initial placement: within a location, each accelerator gets a primary model, the models' shares of the
location's accelerators following their popularity (largest remainder, most popular first when there are
fewer accelerators than models); then each accelerator fills its remaining memory with the most popular
models it does not hold yet. Models not warm where a request lands are loaded on demand (the cold-load time
of the profile), evicting the least recently used idle model when memory is short.
"""

from __future__ import annotations

import math

import numpy as np
import simpy

from edgeinfer.fleet.sim_demand import Arrivals
from edgeinfer.fleet.sim_geo import Metro
from edgeinfer.fleet.sim_host import make_cpu
from edgeinfer.fleet.sim_node import Board, Node, NodeShape, SimRequest
from edgeinfer.fleet.sim_profile import ModelProfile, Profile
from edgeinfer.fleet.sim_scenario import Scenario
from edgeinfer.router import policy as router_policy
from edgeinfer.router.geo import EARTH_RADIUS_KM, NetworkModel


class Records:
    """Per-request outcomes, indexed like the arrivals. Times in seconds, as the client sees them."""

    def __init__(self, n: int, router_s: float = 0.0) -> None:
        self.router_s = router_s
        self.ttft = np.full(n, np.nan)
        self.e2e = np.full(n, np.nan)
        self.node = np.full(n, -1, dtype=np.int64)
        self.rtt = np.full(n, np.nan)
        self.cached = np.zeros(n, dtype=np.int64)

    def first_token(self, req: SimRequest, now: float) -> None:
        self.ttft[req.idx] = now - req.arrival + req.rtt_s + self.router_s
        self.cached[req.idx] = req.cached

    def finish(self, req: SimRequest, now: float) -> None:
        self.e2e[req.idx] = now - req.arrival + req.rtt_s + self.router_s


class SimFleet:
    def __init__(self, scenario: Scenario, profile: Profile, locations: list[Metro], n_requests: int) -> None:
        self.scenario, self.locations = scenario, locations
        self.env = simpy.Environment()
        self.cpu = make_cpu(self.env, scenario.host)  # one processor per node, or the host they share
        self.model_names = [m.name for m in scenario.models]
        self.model_profiles: list[ModelProfile] = [profile.model(m.profile) for m in scenario.models]
        self.rtt_s = rtt_matrix(locations, scenario.network.path_inflation, scenario.network.last_mile_ms)
        self._rtt = self.rtt_s.tolist()
        self._index = {loc.code: i for i, loc in enumerate(locations)}
        k = min(scenario.report.candidate_locations, len(locations))
        self.nearest = np.argsort(self.rtt_s, axis=1, kind="stable")[:, :k].tolist()
        self.records = Records(n_requests, scenario.network.router_ms / 1000)
        self.counts = apportion(scenario, locations)
        self.board = Board(sum(self.counts), len(scenario.models))
        self.nodes: list[Node] = []
        self.by_location: list[list[Node]] = []
        self._build_nodes()
        self.node_by_name = {n.name: n for n in self.nodes}
        self._hostable = [
            frozenset(m for m, p in zip(self.model_names, self.model_profiles, strict=True) if n.can_host(p))
            for n in self.nodes
        ]
        self._name_sets: dict[frozenset[int], frozenset[str]] = {}
        self._states: list[router_policy.NodeState | None] = [None] * len(self.nodes)
        codes = [loc.code for loc in locations]
        # The router policy's view per client city: the nodes of its nearest locations, and RTTs by code.
        self.candidates = [[n for loc in near for n in self.by_location[loc]] for near in self.nearest]
        self._rtt_by_codes = {
            (codes[a], codes[b]): self._rtt[a][b] for a, near in enumerate(self.nearest) for b in near
        }
        self.rejected = 0

    # ---- construction ----------------------------------------------------------------------------
    def _build_nodes(self) -> None:
        nodes = self.scenario.nodes
        shape = NodeShape(
            memory_gb=nodes.memory_gb,
            max_batch=nodes.max_batch,
            busy_queue=nodes.busy_queue,
            max_batched_tokens=nodes.max_batched_tokens,
        )
        pop = [m.popularity for m in self.scenario.models]
        for loc, count in enumerate(self.counts):
            here = []
            for primary in _largest_remainder(count, pop):
                node = Node(
                    env=self.env,
                    node_id=len(self.nodes),
                    location=loc,
                    shape=shape,
                    board=self.board,
                    on_first_token=self.records.first_token,
                    on_finish=self.records.finish,
                    cpu=self.cpu,
                )
                self._place(node, primary, pop)
                self.nodes.append(node)
                here.append(node)
            self.by_location.append(here)

    def _place(self, node: Node, primary: int, pop: list[float]) -> None:
        by_popularity = sorted(range(len(pop)), key=lambda m: -pop[m])
        for m in [primary, *by_popularity]:
            profile = self.model_profiles[m]
            used = sum(s.profile.memory_gb for s in node.slots.values())
            if m not in node.slots and used + profile.memory_gb <= node.shape.memory_gb:
                node.ensure_model(m, profile, preload=True)

    # ---- what the router's policy sees ------------------------------------------------------------
    def rtt_by_code(self, a: str, b: str) -> float:
        rtt = self._rtt_by_codes.get((a, b))
        return self._rtt[self._index[a]][self._index[b]] if rtt is None else rtt

    def _names(self, models: frozenset[int]) -> frozenset[str]:
        names = self._name_sets.get(models)
        if names is None:
            names = self._name_sets[models] = frozenset(self.model_names[m] for m in models)
        return names

    def node_state(self, node: Node) -> router_policy.NodeState:
        """The node's status as the router would see it, rebuilt only when the node changed since."""
        state = self._states[node.node_id]
        if state is None or node.changed:
            state = self._states[node.node_id] = self.fresh_state(node)
            node.changed = False
        return state

    def fresh_state(self, node: Node) -> router_policy.NodeState:
        # ts = 0 with no staleness bound (policy_config): the simulated status is live, never stale.
        return router_policy.NodeState(
            node_id=node.name,
            location=self.locations[node.location].code,
            models_available=self._hostable[node.node_id],
            models_warm=self._names(node.warm_set),
            models_loading=self._names(node.loading_set),
            queue_depth=node.queue_depth,
            running=node.num_running,
            kv_usage=node.kv_usage(),
            capacity=node.capacity,
            ts=0.0,
        )

    def policy_config(self) -> router_policy.PolicyConfig:
        """The constants a router operator would set for this fleet: each model's costs from its profile."""
        models = {
            m.name: model_costs(
                prof, m.prompt_tokens.median, m.output_tokens.median, self.scenario.nodes.max_batch
            )
            for m, prof in zip(self.scenario.models, self.model_profiles, strict=True)
        }
        return router_policy.PolicyConfig(
            busy_queue_depth=self.scenario.nodes.busy_queue,
            stale_after_s=math.inf,
            drop_after_s=math.inf,
            models=models,
        )

    # ---- the request feed ------------------------------------------------------------------------
    def feed(self, arrivals: Arrivals, policy, progress=None):
        """SimPy process: each request at its time, to the first node the policy ranks that accepts it."""
        cols = [arrivals.time, arrivals.city, arrivals.model, arrivals.prompt, arrivals.output,
                arrivals.prefix_key, arrivals.prefix_len]  # fmt: skip
        env, rtt, records = self.env, self._rtt, self.records
        for i, (t, city, model, prompt, output, key, plen) in enumerate(
            zip(*(c.tolist() for c in cols), strict=True)
        ):
            if t > env.now:
                yield env.timeout(t - env.now)
            req = SimRequest(idx=i, model=model, prompt=prompt, output=output, prefix_key=key,
                             prefix_len=plen, arrival=t, rtt_s=0.0)  # fmt: skip
            self.cpu.background(requests=1)  # the router's and the client's part, served or not
            ranked = policy.choose(req, city)
            for node in ranked if policy.retries else ranked[:1]:
                req.rtt_s = rtt[city][node.location]
                if node.submit(req, self.model_profiles[model]):
                    records.node[i] = node.node_id
                    records.rtt[i] = req.rtt_s
                    break
            else:
                self.rejected += 1
            if progress is not None and i % 5000 == 0:
                progress.update(5000 if i else 0)


def model_costs(
    profile: ModelProfile, prompt: float, output: float, max_batch: int
) -> router_policy.ModelCosts:
    """The policy's constants for one model, from its profile at a typical request (median prompt and
    output) in a half-full batch."""
    half = max(1, max_batch // 2)
    step = profile.step_s(half, half * (prompt + output / 2))
    return router_policy.ModelCosts(
        prefill_tokens_per_s=profile.prefill_tok_s,
        cold_load_s=profile.load_s,
        service_time_s=output * step,
        # A newcomer waits for the step in progress, on average half of one; each running request's share.
        wait_per_running_s=step / half / 2,
        wait_per_queued_s=profile.prefill_s(int(prompt)),
    )


def rtt_matrix(locations: list[Metro], inflation: float, last_mile_ms: float) -> np.ndarray:
    """Seconds between every pair, by the router's network model (router/geo.py) over a vectorised
    haversine."""
    lat = np.radians([loc.lat for loc in locations])
    lon = np.radians([loc.lon for loc in locations])
    dlat, dlon = lat[:, None] - lat[None, :], lon[:, None] - lon[None, :]
    h = np.sin(dlat / 2) ** 2 + np.cos(lat)[:, None] * np.cos(lat)[None, :] * np.sin(dlon / 2) ** 2
    km = 2 * EARTH_RADIUS_KM * np.arcsin(np.minimum(1.0, np.sqrt(h)))
    return NetworkModel(path_inflation=inflation, last_mile_ms=last_mile_ms).rtt_s_from_km(km)


def apportion(scenario: Scenario, locations: list[Metro]) -> list[int]:
    nodes = scenario.nodes
    if nodes.per_location:
        if len(nodes.per_location) != len(locations):
            raise ValueError(f"nodes.per_location has {len(nodes.per_location)} entries for {len(locations)}")
        return list(nodes.per_location)
    spare = nodes.accelerators - nodes.min_per_location * len(locations)
    if spare < 0:
        raise ValueError(f"{nodes.accelerators} accelerators < {nodes.min_per_location} x {len(locations)}")
    extra = _largest_remainder(spare, [loc.population for loc in locations])
    counts = [nodes.min_per_location] * len(locations)
    for loc in extra:
        counts[loc] += 1
    return counts


def _largest_remainder(total: int, weights: list[float]) -> list[int]:
    """`total` items given to indices in proportion to `weights`; returns the index of each item."""
    w = np.asarray(weights, dtype=float)
    quota = total * w / w.sum()
    counts = np.floor(quota).astype(int)
    order = np.lexsort((np.arange(len(w)), -(quota - counts)))
    counts[order[: total - counts.sum()]] += 1
    by_weight = np.lexsort((np.arange(len(w)), -w))
    return [int(i) for i in by_weight for _ in range(counts[i])]

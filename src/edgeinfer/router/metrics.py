"""Prometheus series of a router, under `edgeinfer_router:`. Labels stay bounded: locations and nodes
come from the fleet file, tenants from the tenants file, outcomes are HTTP statuses or a few words."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from edgeinfer.obs.metrics import TTFT_BUCKETS, histogram
from edgeinfer.router.breaker import STATE_VALUES
from edgeinfer.router.fleet_file import NodeEntry

PREFIX = "edgeinfer_router:"
DECISION_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 1e-2)
# The router's own share: sub-millisecond when idle, up to seconds when retries or a saturated core add up.
ADDED_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class RouterMetrics:
    def __init__(self, breaker_states: Callable[[], Iterable[tuple[str, str]]]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.routed = Counter(
            PREFIX + "routed_requests",
            "Node answers by node and outcome.",
            ["location", "node", "outcome"],
            registry=r,
        )
        self._routed: dict[tuple[str, str], Any] = {}
        self.spillovers = Counter(
            PREFIX + "spillovers",
            "Requests sent away from the nearest location with the model warm.",
            ["client_location"],
            registry=r,
        )
        self.rejected = Counter(
            PREFIX + "rejected_requests", "Every candidate busy: 429.", ["model"], registry=r
        )
        self.retries = Counter(
            PREFIX + "retries", "Attempts on another node before the first byte.", registry=r
        )
        self.decision = histogram(r, PREFIX + "decision_seconds", "Time to rank the nodes.", DECISION_BUCKETS)
        self.first_byte = histogram(
            r,
            PREFIX + "first_byte_seconds",
            "Arrival at the router to the node's response headers (retries included).",
            TTFT_BUCKETS,
        )
        self.added = histogram(
            r,
            PREFIX + "added_latency_seconds",
            "Arrival to the response headers sent to the client, minus the answering node's own time "
            "to its headers and minus emulated RTT: validation, decision, failed attempts, relaying.",
            ADDED_BUCKETS,
        )
        self._tenant_series(r)
        r.register(_BreakerCollector(breaker_states))

    def _tenant_series(self, r: CollectorRegistry) -> None:
        """Fleet limits (router/limits/) per tenant."""
        self.tenant_admitted = Counter(
            PREFIX + "tenant_admitted_requests",
            "Requests admitted against the tenant's limits: by the fleet's budget, or by this router's "
            "own count while the budget's store is out (`via`).",
            ["tenant", "via"],
            registry=r,
        )
        self.tenant_rejected = Counter(
            PREFIX + "tenant_rejected_requests",
            "Requests refused by the tenant's fleet limits, by the limit (requests, tokens, concurrent "
            "requests) or the outage policy (outage).",
            ["tenant", "limit"],
            registry=r,
        )
        self.tenant_billed_tokens = Counter(
            PREFIX + "tenant_billed_tokens",
            "Tokens (prompt + output) the nodes billed for requests this router admitted.",
            ["tenant"],
            registry=r,
        )
        self.tenant_billed_cost = Counter(
            PREFIX + "tenant_billed_cost_units",
            "Cost units the nodes billed for requests this router admitted.",
            ["tenant"],
            registry=r,
        )
        self.limiter_outages = Counter(
            PREFIX + "limiter_outages",
            "Admissions decided without the fleet's limit store (NATS unreachable).",
            registry=r,
        )
        self.tenants_mismatch = Gauge(
            PREFIX + "tenants_file_mismatch",
            "1 while another router of the fleet runs with a different tenants file.",
            registry=r,
        )

    def count(self, entry: NodeEntry, outcome: str) -> None:
        key = (entry.node_id, outcome)
        child = self._routed.get(key)
        if child is None:  # labels() takes a lock and builds a key per call: once per node and outcome
            child = self._routed[key] = self.routed.labels(entry.location, entry.node_id, outcome)
        child.inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _BreakerCollector(Collector):
    def __init__(self, states: Callable[[], Iterable[tuple[str, str]]]) -> None:
        self._states = states

    def collect(self) -> Iterable[Metric]:
        family = GaugeMetricFamily(
            PREFIX + "breaker_state",
            "Circuit breaker per node: 0 closed, 1 half-open, 2 open.",
            labels=["node"],
        )
        for node, state in self._states():
            family.add_metric([node], STATE_VALUES[state])
        yield family

"""Prometheus metrics of a node, named like vLLM's under the `edgeinfer:` prefix.

Every series is labelled by model only (plus a bounded second label where the name says so: status code,
canary kind and model version). Only the `tenant_*` cache series carry a tenant label: their tenants
are the tenants file's (bounded by the operator), and a quota is only useful if each one is visible.
Each `NodeMetrics` owns its registry, so several servers can live in one process (tests do).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from edgeinfer.obs.gpu import GpuCollector
from edgeinfer.obs.timing import LatencyBreakdown

PREFIX = "edgeinfer:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Buckets span a CPU edge box (seconds per token) down to a GPU (milliseconds).
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.4, 0.8, 1.5, 3.0, 6.0, 12.0, 25.0, 50.0, 100.0)
ITL_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2, 2.5, 5.0, 10.0)
REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0)
LOAD_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


def histogram(
    registry: CollectorRegistry, name: str, doc: str, buckets: Sequence[float], labels: Sequence[str] = ()
) -> Histogram:
    """One histogram in `registry` (the node's and the router's series are all made this way)."""
    return Histogram(name, doc, list(labels), buckets=buckets, registry=registry)


@dataclass(frozen=True, kw_only=True)
class EngineGauges:
    """A resident model's scheduler and cache state at scrape time (counters are cumulative per engine).

    None: not known for this model (an upstream member has no KV cache we can see); left out.
    """

    num_running: int
    num_waiting: int
    kv_usage: float | None = None
    prefix_cache_queries: int | None = None
    prefix_cache_hits: int | None = None
    num_preemptions: int | None = None
    cached_blocks_by_tenant: Mapping[str, int] = field(default_factory=dict)
    evicted_blocks_by_tenant: Mapping[str, int] = field(default_factory=dict)
    # speculative decoding per draft source: tokens drafted, and of those accepted
    spec_drafted_by_source: Mapping[str, int] = field(default_factory=dict)
    spec_accepted_by_source: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class RequestMeasure:
    """What the node learned about one request that reached a model (any outcome)."""

    model: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    latency: LatencyBreakdown = field(default_factory=LatencyBreakdown)
    inter_token_latencies: Sequence[float] = ()


class NodeMetrics:
    """The node's series; `render()` gives the text exposition for `/metrics`."""

    def __init__(self, engine_source: Callable[[], Mapping[str, EngineGauges]] | None = None) -> None:
        self.registry = CollectorRegistry()
        self._histograms()
        self._counters()
        self._pool_series()
        if engine_source is not None:
            self.registry.register(_EngineCollector(engine_source))
        ProcessCollector(registry=self.registry)
        self.registry.register(GpuCollector())

    def _histograms(self) -> None:
        def hist(name: str, doc: str, buckets: Sequence[float]) -> Histogram:
            return histogram(self.registry, PREFIX + name, doc, buckets, ("model",))

        self.ttft = hist("time_to_first_token_seconds", "Arrival to first token.", TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Gap between consecutive output tokens.", ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to last token.", REQUEST_BUCKETS)
        self.queue = hist("request_queue_time_seconds", "Arrival to first scheduled.", REQUEST_BUCKETS)
        self.prefill = hist(
            "request_prefill_time_seconds", "First scheduled to first token.", REQUEST_BUCKETS
        )
        self.decode = hist("request_decode_time_seconds", "First token to last token.", REQUEST_BUCKETS)

    def _counters(self) -> None:
        r = self.registry
        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens", "Prompt tokens processed.", ["model"], registry=r
        )
        self.generation_tokens = Counter(
            PREFIX + "generation_tokens", "Tokens generated.", ["model"], registry=r
        )
        self.outcomes = Counter(
            PREFIX + "request_outcomes",
            "Finished requests by HTTP status code.",
            ["model", "code"],
            registry=r,
        )
        self.embedding_inputs = Counter(
            PREFIX + "embedding_inputs", "Inputs embedded (texts or token-id lists).", ["model"], registry=r
        )
        self.embedding_batch_size = histogram(
            r,
            PREFIX + "embedding_batch_size",
            "Inputs in each forward pass an embeddings request shared (observed once per pass per request).",
            BATCH_BUCKETS,
            ("model",),
        )
        self.canary = Counter(
            PREFIX + "canary_events",
            "Garbage-output canary hits (nonfinite_logits, degenerate_repetition).",
            ["model", "version", "kind"],
            registry=r,
        )

    def _pool_series(self) -> None:
        r = self.registry
        self.model_loads = Counter(
            PREFIX + "model_loads", "Models loaded into the pool.", ["model"], registry=r
        )
        self.model_evictions = Counter(
            PREFIX + "model_evictions", "Models evicted from the pool.", ["model"], registry=r
        )
        self.model_load_time = histogram(
            r, PREFIX + "model_load_time_seconds", "Time to load a model.", LOAD_BUCKETS, ("model",)
        )
        self.model_resident_bytes = Gauge(
            PREFIX + "model_resident_bytes",
            "Memory held by a resident model (0: not resident).",
            ["model"],
            registry=r,
        )
        self.pool_budget_bytes = Gauge(
            PREFIX + "pool_memory_budget_bytes", "The pool's memory budget.", registry=r
        )

    def count_outcome(self, model: str, status: int) -> None:
        """One finished HTTP request of the inference APIs (`model` "-" when it never named a known one)."""
        self.outcomes.labels(model, str(status)).inc()

    def observe_request(self, m: RequestMeasure) -> None:
        """Record token counts and whatever latencies are known for one request."""
        if m.prompt_tokens:
            self.prompt_tokens.labels(m.model).inc(m.prompt_tokens)
        if m.completion_tokens:
            self.generation_tokens.labels(m.model).inc(m.completion_tokens)
        lat = m.latency
        for hist, value in (
            (self.ttft, lat.ttft),
            (self.e2e, lat.e2e),
            (self.queue, lat.queue),
            (self.prefill, lat.prefill),
            (self.decode, lat.decode),
        ):
            if value is not None:
                hist.labels(m.model).observe(value)
        itl = self.itl.labels(m.model)
        for gap in m.inter_token_latencies:
            itl.observe(gap)

    def observe_embedding(self, model: str, inputs: int, batch_sizes: Sequence[int]) -> None:
        self.embedding_inputs.labels(model).inc(inputs)
        hist = self.embedding_batch_size.labels(model)
        for size in batch_sizes:
            hist.observe(size)

    def canary_hit(self, model: str, version: str, kind: str) -> None:
        self.canary.labels(model, version, kind).inc()

    def model_loaded(self, model: str, seconds: float, memory_bytes: int) -> None:
        self.model_loads.labels(model).inc()
        self.model_load_time.labels(model).observe(seconds)
        self.model_resident_bytes.labels(model).set(memory_bytes)

    def model_evicted(self, model: str) -> None:
        self.model_evictions.labels(model).inc()
        self.model_resident_bytes.labels(model).set(0)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector(Collector):
    """Reads each resident engine's stats at scrape time, so gauges are never stale."""

    def __init__(self, source: Callable[[], Mapping[str, EngineGauges]]) -> None:
        self._source = source

    def collect(self) -> Iterable[Metric]:
        stats = self._source()
        gauges = {
            "num_requests_running": ("Requests in the running batch.", lambda s: s.num_running),
            "num_requests_waiting": ("Requests waiting to be scheduled.", lambda s: s.num_waiting),
            "kv_cache_usage_perc": ("Fraction of KV cache blocks in use (0..1).", lambda s: s.kv_usage),
        }
        for name, (doc, get) in gauges.items():
            family = GaugeMetricFamily(PREFIX + name, doc, labels=["model"])
            for model, s in stats.items():
                if (value := get(s)) is not None:
                    family.add_metric([model], value)
            yield family
        counters = {
            "prefix_cache_queries": (
                "Prompt tokens looked up in the cache.",
                lambda s: s.prefix_cache_queries,
            ),
            "prefix_cache_hits": ("Prompt tokens found in the prefix cache.", lambda s: s.prefix_cache_hits),
            "num_preemptions": ("Requests preempted by the scheduler.", lambda s: s.num_preemptions),
        }
        for name, (doc, get) in counters.items():
            family = CounterMetricFamily(PREFIX + name, doc, labels=["model"])
            for model, s in stats.items():
                if (value := get(s)) is not None:
                    family.add_metric([model], value)
            yield family
        yield from _tenant_cache_families(stats)
        yield from _speculative_families(stats)


def _speculative_families(stats: Mapping[str, EngineGauges]) -> Iterable[Metric]:
    """Draft tokens proposed and accepted per model and draft source (as vLLM's spec_decode series), and
    their ratio: how much of the drafting paid."""
    labels = ["model", "source"]
    drafted = CounterMetricFamily(
        PREFIX + "spec_decode_num_draft_tokens",
        "Draft tokens verified (speculative decoding).",
        labels=labels,
    )
    accepted = CounterMetricFamily(
        PREFIX + "spec_decode_num_accepted_tokens", "Draft tokens accepted by verification.", labels=labels
    )
    rate = GaugeMetricFamily(
        PREFIX + "spec_decode_acceptance_rate", "Accepted / drafted tokens since load.", labels=labels
    )
    for model, s in stats.items():
        for source, n in s.spec_drafted_by_source.items():
            ok = s.spec_accepted_by_source.get(source, 0)
            drafted.add_metric([model, source], n)
            accepted.add_metric([model, source], ok)
            rate.add_metric([model, source], ok / n if n else 0.0)
    yield drafted
    yield accepted
    yield rate


def _tenant_cache_families(stats: Mapping[str, EngineGauges]) -> Iterable[Metric]:
    held = GaugeMetricFamily(
        PREFIX + "tenant_cached_blocks",
        "Cached, unreferenced KV blocks a tenant holds (bounded by its cache share under pressure).",
        labels=["model", "tenant"],
    )
    evicted = CounterMetricFamily(
        PREFIX + "tenant_evicted_blocks", "KV blocks of a tenant's evicted from the prefix cache.",
        labels=["model", "tenant"],
    )  # fmt: skip
    for model, s in stats.items():
        for tenant, n in s.cached_blocks_by_tenant.items():
            held.add_metric([model, tenant], n)
        for tenant, n in s.evicted_blocks_by_tenant.items():
            evicted.add_metric([model, tenant], n)
    yield held
    yield evicted

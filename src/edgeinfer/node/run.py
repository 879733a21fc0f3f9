"""One admitted request's resources and its single, synchronous end-of-life bookkeeping."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from edgeinfer.node.embeddings import EmbeddingJob
from edgeinfer.node.jobs import Job, Outcome
from edgeinfer.node.metering import UsageRecord, UsageStore
from edgeinfer.node.prices import PriceTable
from edgeinfer.node.ratelimit import Admission
from edgeinfer.node.tenants import Tenant
from edgeinfer.obs.metrics import NodeMetrics, RequestMeasure
from edgeinfer.pool.manager import Lease

STATUS_CLIENT_CLOSED = 499  # nginx's code for "the client went away before the answer was complete"


@dataclass
class RequestRun:
    """Holds the lease and the rate-limit admission of one request until `finish` releases them.

    `finish` is synchronous and idempotent: it runs from a streaming generator that may be closing
    under cancellation (client gone), where awaiting is not reliable.
    """

    job: Job | EmbeddingJob
    tenant: Tenant
    model: str
    admission: Admission
    lease: Lease
    metrics: NodeMetrics
    store: UsageStore
    prices: PriceTable
    access: dict[str, Any]
    outcome: Outcome = field(default_factory=Outcome)
    started: bool = False
    _done: bool = field(default=False, init=False)

    def finish(self, status: int) -> None:
        if self._done:
            return
        self._done = True
        self.lease.release()
        usage = self.outcome.usage
        self.admission.settle_tokens(usage.total_tokens)
        self.admission.release()
        if self.started:
            self._meter(status)
            self._observe()
        self.access.update(
            status=status,
            prompt_tokens=usage.prompt_tokens,
            cached_tokens=usage.cached_tokens,
            completion_tokens=usage.completion_tokens,
            **self.outcome.latency.as_ms(),
        )

    def _meter(self, status: int) -> None:
        usage = self.outcome.usage
        price = self.prices.price(self.model, self.tenant.prices)
        self.store.append(
            UsageRecord(
                ts=time.time(),
                tenant=self.tenant.name,
                model=self.model,
                request_id=self.job.request_id,
                endpoint=self.job.endpoint,
                status=status,
                input_tokens=usage.prompt_tokens,
                cached_input_tokens=usage.cached_tokens,
                output_tokens=usage.completion_tokens,
                cost_units=price.cost(usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens),
            )
        )

    def _observe(self) -> None:
        usage = self.outcome.usage
        self.metrics.observe_request(
            RequestMeasure(
                model=self.model,
                prompt_tokens=usage.prompt_tokens,
                completion_tokens=usage.completion_tokens,
                latency=self.outcome.latency,
                inter_token_latencies=self.outcome.inter_token_latencies,
            )
        )
        for kind in self.outcome.canary:
            self.metrics.canary_hit(self.model, self.outcome.version or "unknown", kind)

"""One admitted request's resources and its single, synchronous end-of-life bookkeeping."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from edgeinfer.api.embeddings import EmbeddingJob
from edgeinfer.api.errors import ApiError
from edgeinfer.api.jobs import Job
from edgeinfer.api.tenants import Tenant
from edgeinfer.node.backends.base import Outcome
from edgeinfer.node.billing.capacity import Reservation
from edgeinfer.node.billing.metering import STATUS_INTERRUPTED, UsageRecord, UsageStore
from edgeinfer.node.billing.prices import PriceTable
from edgeinfer.node.billing.ratelimit import Admission
from edgeinfer.obs.metrics import NodeMetrics, RequestMeasure
from edgeinfer.pool.manager import Lease
from edgeinfer.types import Usage
from edgeinfer.types.request import Lane


@dataclass(kw_only=True)
class RequestRun:
    """Holds the lease and the rate-limit admission of one request until `finish` releases them.

    `finish` is synchronous and idempotent: it runs from a streaming generator that may be closing
    under cancellation (client gone), where awaiting is not reliable.

    From `start` to `finish` the run is in `live` (keyed by its request id), where `checkpoint` finds it.
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
    live: dict[str, RequestRun]
    reservation: Reservation | None = None  # the request's place at its model (set once admitted there)
    outcome: Outcome = field(default_factory=Outcome)
    started: bool = False
    _done: bool = field(default=False, init=False)
    _checkpointed: Usage | None = field(default=None, init=False)

    def start(self) -> None:
        """The request reaches its model: from now on it is metered."""
        self.started = True
        self.live[self.job.request_id] = self

    def checkpoint(self) -> None:
        """Save the usage so far (if it changed), so that a crash does not lose it."""
        usage = dataclasses.replace(self.outcome.usage)
        if not self._done and usage != self._checkpointed:
            self._checkpointed = usage
            self.store.checkpoint(self._record(STATUS_INTERRUPTED))

    @contextmanager
    def finish_on_error(self) -> Iterator[None]:
        """Finish the run with the error's status (500 for anything not an API error) and re-raise."""
        try:
            yield
        except ApiError as exc:
            self.finish(exc.status)
            raise
        except BaseException:
            self.finish(500)
            raise

    def finish(self, status: int) -> None:
        if self._done:
            return
        self._done = True
        self.live.pop(self.job.request_id, None)
        self.lease.release()
        if self.reservation is not None:
            self.reservation.release()
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
        ttft = self.outcome.latency.ttft
        self.store.append(
            dataclasses.replace(
                self._record(status),
                ttft_ms=None if ttft is None else round(ttft * 1000, 3),
                duration_ms=round((time.monotonic() - self.job.arrival) * 1000, 3),
                http_request_id=self.access.get("request_id"),
            )
        )

    def _record(self, status: int) -> UsageRecord:
        usage = self.outcome.usage
        price = self.prices.price(self.model, self.tenant.prices)
        return UsageRecord(
            ts=time.time(),
            tenant=self.tenant.name,
            model=self._metered_model,
            request_id=self.job.request_id,
            endpoint=self.job.endpoint,
            status=status,
            input_tokens=usage.prompt_tokens,
            cached_input_tokens=usage.cached_tokens,
            output_tokens=usage.completion_tokens,
            cost_units=price.cost(
                usage.prompt_tokens,
                usage.cached_tokens,
                usage.completion_tokens,
                batch=self.job.lane is Lane.BATCH,
            ),
        )

    @property
    def _metered_model(self) -> str:
        """The model as usage records name it: a LoRA adapter's requests as `base:adapter`, apart from the
        base's own (priced as the base)."""
        adapter = getattr(self.job, "adapter", None)
        return f"{self.model}:{adapter}" if adapter else self.model

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

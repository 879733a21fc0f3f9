"""The request pipeline shared by every inference route:
authenticate → resolve model → admit (rate limits) → lease a pool member (loading it) → check the
queue → prepare (tokenize, limits, token reservation) → run → respond or stream → meter and observe.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from fastapi.responses import Response
from starlette.requests import Request

from edgeinfer.api.embeddings import EmbeddingJob
from edgeinfer.api.errors import (
    ApiError,
    bad_request,
    busy,
    internal,
    model_not_found,
    rate_limited,
    unavailable,
    upstream_failed,
)
from edgeinfer.api.jobs import Job
from edgeinfer.api.limits import NodeLimits
from edgeinfer.api.tenants import Tenant, TenantRegistry
from edgeinfer.api.usage import usage_body
from edgeinfer.node.adapters import NodeAdapters
from edgeinfer.node.backends.base import Backend
from edgeinfer.node.backends.embedding_run import (
    EmbeddingOutcome,
    embedding_inputs,
    run_embeddings,
    wrong_task,
)
from edgeinfer.node.backends.registry import open_backend
from edgeinfer.node.billing.capacity import Capacity
from edgeinfer.node.billing.metering import UsageStore
from edgeinfer.node.billing.prices import PriceTable
from edgeinfer.node.billing.ratelimit import Admission, RateLimiter, RateLimitExceeded
from edgeinfer.node.finetunes import NodeFinetunes
from edgeinfer.node.http.answer import collect, respond, stream
from edgeinfer.node.http.render import Renderer, WorkersAIRenderer
from edgeinfer.node.run import RequestRun
from edgeinfer.obs.metrics import NodeMetrics
from edgeinfer.pool.manager import Lease, ModelPool, PoolCapacityError, UnknownModelError
from edgeinfer.pool.member import EMBED, PoolMember
from edgeinfer.pool.upstream import UpstreamError
from edgeinfer.types.request import Lane

logger = logging.getLogger("edgeinfer.node")


class NodeService:
    def __init__(
        self,
        *,
        limits: NodeLimits,
        pool: ModelPool,
        tenants: TenantRegistry,
        limiter: RateLimiter,
        store: UsageStore,
        prices: PriceTable,
        metrics: NodeMetrics,
        stream_write_timeout_s: float,
        finetunes: NodeFinetunes,
    ) -> None:
        self.limits = limits
        self.stream_write_timeout_s = stream_write_timeout_s
        self.pool = pool
        self.tenants = tenants
        self.limiter = limiter
        self.store = store
        self.prices = prices
        self.metrics = metrics
        self.capacity = Capacity(limits.max_queue_depth)
        self._live: dict[str, RequestRun] = {}  # requests at their model, for usage checkpoints
        self.adapters = NodeAdapters(pool, finetunes)

    async def execute(
        self, request: Request, tenant: Tenant, job: Job, renderer_cls: type[Renderer]
    ) -> Response:
        access = request.state.access
        access.update(
            response_id=job.request_id, tenant=tenant.name, endpoint=job.endpoint, stream=job.stream
        )
        model, tenant = await self._generation_target(job, tenant)
        access["model"] = model
        if job.adapter is not None:
            access["adapter"] = job.adapter
        headers: dict[str, str] = {}
        if affinity := request.headers.get("x-session-affinity"):
            headers["x-session-affinity"] = access["session_affinity"] = affinity
        run, backend = await self._start(job, tenant, model, access)
        renderer = renderer_cls(job, backend.version)
        if job.stream:
            return await stream(request, run, backend, renderer, headers, self.stream_write_timeout_s)
        return await respond(request, run, backend, renderer, headers)

    async def run_queued(self, tenant: Tenant, job: Job) -> dict[str, Any]:
        """Run a queued Batch-API entry (no client waits on it) through the same admission, pool, limits
        and metering as any request; its Workers-AI `result`. ApiError as any route would answer."""
        model, tenant = await self._generation_target(job, tenant)
        access: dict[str, Any] = {"request_id": job.request_id, "tenant": tenant.name, "model": model}
        run, backend = await self._start(job, tenant, model, access)
        collected = await collect(run, backend)
        return WorkersAIRenderer(job, backend.version).response(collected, run.outcome.usage)["result"]

    def model_task(self, name: str) -> str:
        """generate or embed, for a model name or alias (404 if unknown)."""
        return self.pool.task(self.resolve(name))

    async def embed(self, request: Request, tenant: Tenant, job: EmbeddingJob) -> EmbeddingOutcome | None:
        """Run an embeddings job through the same admission, pool, limits and metering as generation;
        None when the client went away before the vectors were ready."""
        access = request.state.access
        access.update(response_id=job.request_id, tenant=tenant.name, endpoint=job.endpoint, stream=False)
        return await self._embed(request, tenant, job, access)

    async def embed_queued(self, tenant: Tenant, job: EmbeddingJob) -> dict[str, Any]:
        """A queued Batch-API entry for an embedding model: its Workers-AI `result` (shape, data)."""
        access: dict[str, Any] = {"request_id": job.request_id, "tenant": tenant.name}
        outcome = await self._embed(None, tenant, job, access)
        assert outcome is not None  # only a client that left ends without vectors
        return {"shape": list(outcome.vectors.shape), "data": outcome.vectors.tolist()}

    async def _embed(
        self, request: Request | None, tenant: Tenant, job: EmbeddingJob, access: dict[str, Any]
    ) -> EmbeddingOutcome | None:
        model = self.resolve(job.model)
        access["model"] = model
        if self.pool.task(model) != EMBED:
            raise wrong_task(model, self.pool.task(model))
        run = await self._open_run(job, tenant, model, access)
        with run.finish_on_error():
            ids = await embedding_inputs(run, self.limits)
            _reserve_tokens(run, sum(len(seq) for seq in ids))
        return await run_embeddings(request, run, ids)

    async def _generation_target(self, job: Job, tenant: Tenant) -> tuple[str, Tenant]:
        """The model a generation job runs on, after the checks every generation job passes first: the
        tenant's priority range, the model (or the tenant's adapter of it), and its task; the tenant with
        the adapter among its own where the job names an uploaded finetune."""
        tenant.check_priority(job.priority)
        try:
            model, tenant = await self.adapters.target(job, tenant)
        except UnknownModelError as exc:
            raise model_not_found(str(exc)) from None
        if self.pool.task(model) == EMBED:
            raise wrong_task(model, EMBED)
        return model, tenant

    def resolve(self, name: str) -> str:
        """The canonical name of a model or alias (404 if unknown)."""
        try:
            return self.pool.resolve(name)
        except UnknownModelError as exc:
            raise model_not_found(str(exc)) from None

    async def _open_run(
        self, job: Job | EmbeddingJob, tenant: Tenant, model: str, access: dict[str, Any]
    ) -> RequestRun:
        """Admit the tenant (rate limits) and lease the model; from here on `run.finish` releases both."""
        admission = _admit(self.limiter, tenant)
        try:
            self._check_load_queue(model, job)
            lease = await self._acquire(model)
        except BaseException:
            admission.cancel()
            raise
        return RequestRun(
            job=job,
            tenant=tenant,
            model=model,
            admission=admission,
            lease=lease,
            metrics=self.metrics,
            store=self.store,
            prices=self.prices,
            access=access,
            live=self._live,
        )

    async def _start(
        self, job: Job, tenant: Tenant, model: str, access: dict[str, Any]
    ) -> tuple[RequestRun, Backend]:
        run = await self._open_run(job, tenant, model, access)
        with run.finish_on_error():
            member: PoolMember = run.lease.member
            await self.adapters.ensure(member, tenant, job)
            backend = open_backend(member, self.limits, tenant)
            if job.lane is Lane.INTERACTIVE:
                # Batch work is bounded by the batch worker and gives way to this, so it is not counted.
                load = member.stats()
                waiting = load.num_waiting - load.num_waiting_batch
                # no await between the check and the reservation: a burst cannot overshoot the queue
                run.reservation = self.capacity.reserve(
                    model, job.num_choices, load.seats, waiting, job.reject_if_busy
                )
            _reserve_tokens(run, backend.prepare(job))
        return run, backend

    def _check_load_queue(self, model: str, job: Job | EmbeddingJob) -> None:
        if job.reject_if_busy and not self.pool.is_resident(model):
            self.pool.prefetch(model)  # so that a retry finds it warm
            raise busy(f"model {model} is not loaded yet (rejectIfBusy); it is loading now, retry shortly")
        if self.pool.waiting_for_load(model) >= self.limits.max_queue_depth:
            raise busy(f"model {model} has {self.limits.max_queue_depth} requests waiting for it to load")

    async def _acquire(self, model: str) -> Lease:
        try:
            return await self.pool.acquire(model)
        except PoolCapacityError as exc:
            raise unavailable(str(exc)) from None
        except UpstreamError as exc:
            raise upstream_failed(exc.status, exc.message) from None
        except (ValueError, OSError):  # a checkpoint that cannot be read or built
            logger.exception("loading model %s failed", model)
            raise internal(f"model {model} failed to load; the server log has the details") from None

    async def checkpoint_usage(self, interval_s: float) -> None:
        """Forever: every `interval_s`, save the usage of every request in flight."""
        while True:
            await asyncio.sleep(interval_s)
            for run in list(self._live.values()):
                run.checkpoint()

    async def settle(self, timeout_s: float) -> None:
        """Until every request in flight has finished (billed, its lease returned), for at most `timeout_s`:
        at shutdown, the streams the server cancelled close while their engines still answer."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while self._live and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)

    async def usage(self, tenant: Tenant, start: float | None, end: float | None) -> dict[str, Any]:
        """The tenant's usage per model (everything appended so far is flushed first)."""
        await asyncio.to_thread(self.store.flush)
        rows = await asyncio.to_thread(self.store.summary, tenant.name, start, end)
        return usage_body(tenant.name, start, end, rows)


def _admit(limiter: RateLimiter, tenant: Tenant) -> Admission:
    try:
        return limiter.admit(tenant)
    except RateLimitExceeded as exc:
        raise _limit_error(exc) from None


def _limit_error(exc: RateLimitExceeded) -> ApiError:
    # A request that can never fit the window is the client's to fix, not to retry.
    return bad_request(exc.message) if exc.retry_after is None else rate_limited(exc.message, exc.retry_after)


def _reserve_tokens(run: RequestRun, tokens: int) -> None:
    """Charge the request's tokens to the tenant's per-minute budget (429 beyond it)."""
    try:
        run.admission.reserve_tokens(tokens)
    except RateLimitExceeded as exc:
        raise _limit_error(exc) from None

"""`FleetLimiter`: a router's admission against its tenants' fleet-wide limits (package docstring)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from edgeinfer.api.errors import ApiError, bad_request, rate_limited, unavailable
from edgeinfer.api.tenants import OutagePolicy, Tenant
from edgeinfer.router.limits.leases import LocalWindow, SlotLease, WindowLease
from edgeinfer.router.limits.store import (
    SLOTS_BUCKET,
    WINDOWS_BUCKET,
    StoreUnavailable,
    open_bucket,
)
from edgeinfer.types.usage_event import UsageEvent

logger = logging.getLogger("edgeinfer.router")
# How long a window's counters stay in the bucket after it ends, in windows (the bucket's age limit).
KEPT_WINDOWS = 3


@dataclass(frozen=True, kw_only=True)
class FleetLimitsConfig:
    """`window_s`: the length of the fixed windows that requests_per_minute and tokens_per_minute count
    in (60: per minute; tests shorten it, and the limits then count per window). A lease takes
    `slice_fraction` of a limit at a time (at least what the request needs); what a router holds goes
    back to the bucket after `idle_return_s` unused; its concurrency slots expire `slot_ttl_s` after it
    last kept them ahead. `op_timeout_s` bounds one bucket operation before it counts as an outage."""

    window_s: float = 60.0
    slice_fraction: float = 0.05
    idle_return_s: float = 1.0
    slot_ttl_s: float = 15.0
    op_timeout_s: float = 0.5

    def __post_init__(self) -> None:
        if not (self.window_s > 0 and 0 < self.slice_fraction <= 1 and self.idle_return_s > 0):
            raise ValueError("fleet limits: window_s and idle_return_s must be > 0, slice_fraction in (0, 1]")


@dataclass(kw_only=True)
class _TenantLeases:
    tenant: Tenant
    requests: WindowLease | None
    tokens: WindowLease | None
    slots: SlotLease | None
    local_requests: LocalWindow | None
    local_tokens: LocalWindow | None
    local_in_use: int = 0


@dataclass(kw_only=True)
class FleetAdmission:
    """One admitted request's share of its tenant's budgets until `end`."""

    limiter: FleetLimiter
    request_id: str
    leases: _TenantLeases
    window: int
    tokens: int
    fleet: bool  # admitted against the bucket (False: against this router's own counts, in an outage)
    ended: bool = field(default=False, init=False)

    @property
    def slot(self) -> bool:
        """Whether it holds a concurrency slot (its tenant has a concurrency limit)."""
        return self.leases.tenant.limits.max_concurrent is not None

    def end(self, status: int) -> None:
        """The answer went out (`status`): the concurrency slot is free again, and a request refused
        anyway (status >= 400: nothing was served) gives its request and tokens back. Idempotent; no
        I/O, so it may run where awaiting is not possible (a stream closing under cancellation)."""
        if self.ended:
            return
        self.ended = True
        self.limiter.end(self, refund=status >= 400)


class FleetLimiter:
    def __init__(
        self,
        js: Any,
        router_id: str,
        config: FleetLimitsConfig,
        metrics: Any,
        connected: Callable[[], bool],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.router_id = router_id
        self.config = config
        self._js = js
        self._metrics = metrics
        self._connected = connected
        self._clock = clock
        self._windows: Any = None
        self._slots: Any = None
        self._tenants: dict[str, _TenantLeases] = {}
        # request id -> its admission, until the node's usage event settles the token reservation
        self._pending: dict[str, FleetAdmission] = {}
        self._task: asyncio.Task[None] | None = None
        self._last_outage_log = 0.0

    async def start(self) -> None:
        ttl = KEPT_WINDOWS * self.config.window_s
        self._windows = await open_bucket(self._js, WINDOWS_BUCKET, ttl)
        self._slots = await open_bucket(self._js, SLOTS_BUCKET, None)
        self._task = asyncio.create_task(self._maintain(), name="fleet-limits")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._return_everything()

    def window(self, now: float) -> int:
        return int(now // self.config.window_s)

    async def admit(self, tenant: Tenant, request_id: str, tokens: int) -> FleetAdmission | None:
        """Admit a request that may use `tokens` (prompt estimate + n x max_tokens), or raise a 429
        (over a limit) or 503 (the bucket is out and the tenant's policy is closed). None: the tenant
        has no limits."""
        if not tenant.limits.any:
            return None
        leases = self._leases(tenant)
        now = self._clock()
        window = self.window(now)
        fleet = True
        try:
            if not self._connected():
                raise StoreUnavailable("not connected to NATS")
            async with asyncio.timeout(self.config.op_timeout_s):
                await self._take_fleet(leases, tokens, window, now)
        except (StoreUnavailable, TimeoutError) as exc:
            self._take_locally(leases, tokens, window, now, exc)
            fleet = False
        admission = FleetAdmission(
            limiter=self,
            request_id=request_id,
            leases=leases,
            window=window,
            tokens=tokens,
            fleet=fleet,
        )
        self._metrics.tenant_admitted.labels(tenant.name, "fleet" if admission.fleet else "router").inc()
        self._pending[request_id] = admission
        return admission

    async def _take_fleet(self, leases: _TenantLeases, tokens: int, window: int, now: float) -> None:
        taken: list[tuple[WindowLease, int]] = []
        checks = ((leases.requests, 1, "requests"), (leases.tokens, tokens, "tokens"))
        try:
            for lease, amount, what in checks:
                if lease is None:
                    continue
                if not await lease.take(self._windows, amount, window, now):
                    raise self._over(leases.tenant, what, lease.limit, amount, now)
                taken.append((lease, amount))
            if leases.slots is not None and not await leases.slots.acquire(self._slots, now):
                raise self._over(leases.tenant, "concurrent requests", leases.slots.limit, 1, now)
        except BaseException:  # refused, out, or cancelled: what was taken is this router's to spend again
            for lease, amount in taken:
                lease.put_back(amount, window)
            raise

    def _take_locally(
        self, leases: _TenantLeases, tokens: int, window: int, now: float, cause: BaseException
    ) -> None:
        """The bucket is out: the tenant's policy decides (OutagePolicy)."""
        tenant = leases.tenant
        self._metrics.limiter_outages.inc()
        if now - self._last_outage_log > 10:
            self._last_outage_log = now
            logger.warning("fleet limits unreachable (%s): tenants fall back to their outage policy", cause)
        if tenant.limits.on_outage is OutagePolicy.CLOSED:
            self._metrics.tenant_rejected.labels(tenant.name, "outage").inc()
            raise unavailable("the fleet's rate limits cannot be checked right now; retry shortly", 1.0)
        limit = tenant.limits.max_concurrent
        if limit is not None and leases.local_in_use >= limit:
            raise self._over(tenant, "concurrent requests", limit, 1, now)
        checks = ((leases.local_requests, 1, "requests"), (leases.local_tokens, tokens, "tokens"))
        taken: list[tuple[LocalWindow, int]] = []
        for local, amount, what in checks:
            if local is None:
                continue
            if not local.take(amount, window):
                for done, n in taken:
                    done.put_back(n, window)
                raise self._over(tenant, what, local.limit, amount, now)
            taken.append((local, amount))
        leases.local_in_use += limit is not None

    def _over(self, tenant: Tenant, what: str, limit: int, amount: int, now: float) -> ApiError:
        self._metrics.tenant_rejected.labels(tenant.name, what).inc()
        if what == "concurrent requests":
            return rate_limited(f"concurrent request limit of {limit} reached for tenant {tenant.name}", 1.0)
        if amount > limit:  # as the node answers it: no wait would let it through
            return bad_request(
                f"this request may use up to {amount} {what} (prompt + n x max_tokens), more than the "
                f"key's limit of {limit} {what} per window; lower max_tokens",
                "max_tokens",
            )
        # what other routers hold comes back once idle; a new window starts from nothing
        until_next = self.config.window_s - now % self.config.window_s
        retry = min(until_next, self.config.idle_return_s * 2)
        return rate_limited(f"{what} limit of {limit} per window reached for tenant {tenant.name}", retry)

    def end(self, admission: FleetAdmission, refund: bool) -> None:
        leases = admission.leases
        now = self._clock()
        if admission.slot:
            if admission.fleet and leases.slots is not None:
                leases.slots.release(now)
            elif not admission.fleet:
                leases.local_in_use -= 1
        if not refund:
            return
        if self._pending.get(admission.request_id) is admission:
            del self._pending[admission.request_id]
        window = admission.window
        if admission.fleet:
            for lease, amount in ((leases.requests, 1), (leases.tokens, admission.tokens)):
                if lease is not None:
                    lease.put_back(amount, window)
        else:
            for local, amount in ((leases.local_requests, 1), (leases.local_tokens, admission.tokens)):
                if local is not None:
                    local.put_back(amount, window)

    def settle(self, event: UsageEvent) -> None:
        """A node's usage event for a request this router admitted: its tokens replace the reservation
        (the difference goes back to, or comes out of, the window it was admitted in), and the tenant's
        billed series count it."""
        if event.http_request_id is None:
            return
        admission = self._pending.get(event.http_request_id)
        # another router's request, a redelivered event, or a client's id that another tenant also sent
        if admission is None or admission.leases.tenant.name != event.tenant:
            return
        del self._pending[event.http_request_id]
        tenant = admission.leases.tenant.name
        self._metrics.tenant_billed_tokens.labels(tenant).inc(event.total_tokens)
        self._metrics.tenant_billed_cost.labels(tenant).inc(event.cost_units)
        surplus = admission.tokens - event.total_tokens
        if admission.fleet and admission.leases.tokens is not None:
            lease = admission.leases.tokens
            if surplus >= 0:
                lease.put_back(surplus, admission.window)
                return
            short = lease.spend(-surplus, admission.window)
            if short and admission.window == self.window(self._clock()):
                task = asyncio.get_running_loop().create_task(self._force(lease, short, admission.window))
                task.add_done_callback(_log_failure)
        elif admission.leases.local_tokens is not None:
            local = admission.leases.local_tokens
            if surplus >= 0:
                local.put_back(surplus, admission.window)
            elif admission.window == local.window:
                local.used -= surplus

    async def _force(self, lease: WindowLease, units: int, window: int) -> None:
        async with asyncio.timeout(self.config.op_timeout_s):
            await lease.force(self._windows, units, window)

    def _leases(self, tenant: Tenant) -> _TenantLeases:
        leases = self._tenants.get(tenant.name)
        if leases is None:
            leases = self._new_leases(tenant)
            self._tenants[tenant.name] = leases
        return leases

    def _new_leases(self, tenant: Tenant) -> _TenantLeases:
        stem = hashlib.sha256(tenant.name.encode()).hexdigest()[:24]
        limits = tenant.limits

        def window_lease(limit: int | None, kind: str) -> WindowLease | None:
            if limit is None:
                return None
            recheck = self.config.idle_return_s / 2
            return WindowLease(
                name=f"{stem}.{kind}", limit=limit, slice=self._slice(limit), recheck_s=recheck
            )

        def local(limit: int | None) -> LocalWindow | None:
            return None if limit is None else LocalWindow(limit=limit)

        slots = None
        if limits.max_concurrent is not None:
            slots = SlotLease(
                key=stem,
                router=self.router_id,
                limit=limits.max_concurrent,
                slice=self._slice(limits.max_concurrent),
                ttl_s=self.config.slot_ttl_s,
            )
        return _TenantLeases(
            tenant=tenant,
            requests=window_lease(limits.requests_per_minute, "requests"),
            tokens=window_lease(limits.tokens_per_minute, "tokens"),
            slots=slots,
            local_requests=local(limits.requests_per_minute),
            local_tokens=local(limits.tokens_per_minute),
        )

    def _slice(self, limit: int) -> int:
        return max(1, math.floor(limit * self.config.slice_fraction))

    async def _maintain(self) -> None:
        """Give idle leases back, keep held slots from expiring, forget reservations no event settled."""
        while True:
            await asyncio.sleep(self.config.idle_return_s / 2)
            now = self._clock()
            if self._connected():
                await self._maintain_leases(now)
            stale = self.window(now) - 2
            for rid in [rid for rid, a in self._pending.items() if a.window < stale and a.ended]:
                del self._pending[rid]

    async def _maintain_leases(self, now: float) -> None:
        window, idle = self.window(now), self.config.idle_return_s
        for leases in list(self._tenants.values()):
            try:
                async with asyncio.timeout(self.config.op_timeout_s * 4):
                    for lease in (leases.requests, leases.tokens):
                        if lease is not None:
                            await lease.return_idle(self._windows, window, now, idle)
                    if leases.slots is not None:
                        await leases.slots.maintain(self._slots, now, idle)
            except (StoreUnavailable, TimeoutError) as exc:
                logger.debug("fleet limits maintenance: %s", exc)

    async def _return_everything(self) -> None:
        """At shutdown: what this router holds goes back now rather than when it would expire."""
        if not self._connected():
            return
        now = self._clock()
        with contextlib.suppress(StoreUnavailable, TimeoutError):
            async with asyncio.timeout(self.config.op_timeout_s * 4):
                for leases in self._tenants.values():
                    for lease in (leases.requests, leases.tokens):
                        if lease is not None:
                            await lease.give_back(self._windows)
                    if leases.slots is not None:
                        await leases.slots.give_back(self._slots, now)


def _log_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.debug("fleet limits: could not count tokens beyond a reservation: %s", task.exception())

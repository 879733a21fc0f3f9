"""Fleet limits (router/limits/) on a real nats-server with JetStream: several routers' limiters, each on
its own connection, share one budget per tenant; what the bound is, what an outage does."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import nats
import pytest
import pytest_asyncio
from helpers.jetstream import JetStream

from edgeinfer.api.errors import ApiError
from edgeinfer.api.tenants import OutagePolicy, Tenant, TenantLimits
from edgeinfer.router.limits.limiter import FleetLimiter, FleetLimitsConfig
from edgeinfer.router.limits.tenants_check import TenantsCheck, tenants_digest
from edgeinfer.router.metrics import RouterMetrics
from edgeinfer.types.usage_event import UsageEvent

WINDOW_S = 2.0


@pytest.fixture
def jetstream(tmp_path: Path) -> Iterator[JetStream]:
    server = JetStream(tmp_path)
    server.start()
    yield server
    server.stop()


def _tenant(name: str = "alice", policy: OutagePolicy = OutagePolicy.OPEN, **limits: int) -> Tenant:
    return Tenant(name=name, cache_namespace="ns", limits=TenantLimits(**limits, on_outage=policy))


class Routers:
    """R limiters as R routers would run them: one NATS connection each."""

    def __init__(self, url: str, count: int, config: FleetLimitsConfig) -> None:
        self.url, self.count, self.config = url, count, config
        self.connections: list[nats.NATS] = []
        self.limiters: list[FleetLimiter] = []

    async def start(self) -> Routers:
        for i in range(self.count):
            nc = await nats.connect(self.url, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
            limiter = FleetLimiter(
                nc.jetstream(timeout=2.0),
                f"R{i}",
                self.config,
                RouterMetrics(lambda: []),
                lambda nc=nc: nc.is_connected,
            )
            await limiter.start()
            self.connections.append(nc)
            self.limiters.append(limiter)
        return self

    async def stop(self) -> None:
        for limiter, nc in zip(self.limiters, self.connections, strict=True):
            await limiter.stop()
            await nc.close()


@pytest_asyncio.fixture
async def three(jetstream: JetStream) -> AsyncIterator[Routers]:
    routers = await Routers(jetstream.url, 3, FleetLimitsConfig(window_s=WINDOW_S, idle_return_s=0.3)).start()
    yield routers
    await routers.stop()


async def _try(limiter: FleetLimiter, tenant: Tenant, rid: str, tokens: int = 0):
    try:
        return await limiter.admit(tenant, rid, tokens)
    except ApiError as exc:
        return exc


async def _align_to_window_start() -> None:
    """Sleep to just after a window begins, so a short burst stays inside one window."""
    await asyncio.sleep(WINDOW_S - time.time() % WINDOW_S + 0.02)


@pytest.mark.asyncio
async def test_three_routers_together_admit_the_limit_per_window_and_no_more(three: Routers) -> None:
    tenant = _tenant(requests_per_minute=20)
    await _align_to_window_start()
    window = three.limiters[0].window(time.time())
    # 90 requests at once, spread over the three routers: exactly the limit passes
    results = await asyncio.gather(*(_try(three.limiters[i % 3], tenant, f"a{i}") for i in range(90)))
    admitted = [r for r in results if not isinstance(r, ApiError)]
    assert three.limiters[0].window(time.time()) == window, "the burst crossed a window"
    assert len(admitted) == 20
    refused = [r for r in results if isinstance(r, ApiError)]
    assert {r.status for r in refused} == {429} and all(r.retry_after for r in refused)
    # the next window starts from nothing
    await _align_to_window_start()
    more = await asyncio.gather(*(_try(three.limiters[i % 3], tenant, f"b{i}") for i in range(30)))
    assert sum(not isinstance(r, ApiError) for r in more) == 20


@pytest.mark.asyncio
async def test_under_the_limit_every_request_passes_though_leases_sit_on_other_routers(
    three: Routers,
) -> None:
    tenant = _tenant(requests_per_minute=20)
    await _align_to_window_start()
    # each router takes a slice (1 unit at 5 %) and then more as it needs; 19 spread unevenly all pass
    spread = [0] * 10 + [1] * 6 + [2] * 3
    results = [await _try(three.limiters[i], tenant, f"r{n}") for n, i in enumerate(spread)]
    assert not [r for r in results if isinstance(r, ApiError)]


@pytest.mark.asyncio
async def test_tokens_are_reserved_then_settled_by_the_nodes_usage_event(three: Routers) -> None:
    tenant = _tenant(tokens_per_minute=1000)
    first, second = three.limiters[0], three.limiters[1]
    await _align_to_window_start()
    admission = await first.admit(tenant, "big", 800)
    assert isinstance(await _try(second, tenant, "next", 400), ApiError)  # 800 + 400 > 1000
    admission.end(200)
    usage = dict(tenant="alice", model="m", endpoint="/v1/completions", status=200, cost_units=0.0, ts=1.0)
    first.settle(UsageEvent(request_id="cmpl-1", node_id="n1", input_tokens=50, cached_input_tokens=0,
                            output_tokens=50, http_request_id="big", **usage))  # fmt: skip
    await asyncio.sleep(0.5)  # the first router's surplus goes back once idle
    assert not isinstance(await _try(second, tenant, "next2", 400), ApiError)


@pytest.mark.asyncio
async def test_a_refused_answer_gives_its_request_back(three: Routers) -> None:
    tenant = _tenant(requests_per_minute=2)
    limiter = three.limiters[0]
    await _align_to_window_start()
    (await limiter.admit(tenant, "x", 0)).end(429)  # the node said no: nothing was served
    (await limiter.admit(tenant, "y", 0)).end(200)
    assert not isinstance(await _try(limiter, tenant, "z"), ApiError)
    assert isinstance(await _try(limiter, tenant, "w"), ApiError)


@pytest.mark.asyncio
async def test_concurrency_is_bounded_across_routers_and_freed_slots_move_between_them(
    three: Routers,
) -> None:
    tenant = _tenant(max_concurrent=4)
    held = [await three.limiters[i % 3].admit(tenant, f"c{i}", 0) for i in range(4)]
    over = [await _try(lim, tenant, "over") for lim in three.limiters]
    assert all(isinstance(r, ApiError) for r in over)
    held[0].end(200)  # router 0's slot is free at router 0 at once, at the others once it idled back
    assert not isinstance(await _try(three.limiters[0], tenant, "again"), ApiError)
    held[1].end(200)
    await asyncio.sleep(0.8)
    assert not isinstance(await _try(three.limiters[2], tenant, "moved"), ApiError)


@pytest.mark.asyncio
async def test_a_dead_routers_slots_come_back_when_they_expire(jetstream: JetStream) -> None:
    config = FleetLimitsConfig(window_s=WINDOW_S, idle_return_s=0.3, slot_ttl_s=1.5)
    dying, alive = (
        await Routers(jetstream.url, 1, config).start(),
        await Routers(jetstream.url, 1, config).start(),
    )
    tenant = _tenant(max_concurrent=2)
    try:
        for rid in ("a", "b"):
            await dying.limiters[0].admit(tenant, rid, 0)
        assert isinstance(await _try(alive.limiters[0], tenant, "c"), ApiError)
        await dying.connections[0].close()  # as a killed router: its slots are not given back
        await asyncio.sleep(2.0)
        assert not isinstance(await _try(alive.limiters[0], tenant, "d"), ApiError)
    finally:
        await alive.stop()


@pytest.mark.asyncio
async def test_when_nats_is_down_open_tenants_get_the_limit_per_router_and_closed_ones_503(
    jetstream: JetStream,
) -> None:
    routers = await Routers(jetstream.url, 2, FleetLimitsConfig(window_s=30.0, op_timeout_s=0.3)).start()
    open_tenant = _tenant("open", requests_per_minute=3)
    closed = _tenant("closed", OutagePolicy.CLOSED, requests_per_minute=3)
    try:
        jetstream.stop()
        await asyncio.sleep(0.3)
        for limiter in routers.limiters:  # each router alone enforces the whole limit
            results = [await _try(limiter, open_tenant, f"o{i}") for i in range(4)]
            assert [isinstance(r, ApiError) for r in results] == [False, False, False, True]
        refused = await _try(routers.limiters[0], closed, "c")
        assert isinstance(refused, ApiError) and refused.status == 503
        jetstream.start()
        await asyncio.sleep(1.5)  # reconnected: the bucket decides again
        assert not isinstance(await _try(routers.limiters[0], closed, "c2"), ApiError)
    finally:
        await routers.stop()


@pytest.mark.asyncio
async def test_a_router_with_another_tenants_file_is_reported_by_every_router(jetstream: JetStream) -> None:
    nc = await nats.connect(jetstream.url)
    js = nc.jetstream()
    same, other = tenants_digest({"tenants": [{"name": "a"}]}), tenants_digest({"tenants": [{"name": "b"}]})
    assert tenants_digest({"tenants": [{"name": "a"}]}) == same  # formatting aside, the same table
    metrics = [RouterMetrics(lambda: []) for _ in range(3)]
    checks = [
        TenantsCheck(js, router, digest, m)
        for router, digest, m in zip(("r1", "r2", "r3"), (same, same, other), metrics, strict=True)
    ]
    try:
        assert await checks[0].start() == []
        assert await checks[1].start() == []
        assert await checks[2].start() == ["r1", "r2"]
        assert await checks[0].check() == ["r3"]
        assert metrics[0].tenants_mismatch._value.get() == 1
    finally:
        for check in checks:
            await check.stop()
        await nc.close()

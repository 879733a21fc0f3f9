"""The router's FastAPI application: `create_router_app(config, fleet)`."""

from __future__ import annotations

import contextlib
import logging
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI

from edgeinfer import __version__
from edgeinfer.api.files import load_table
from edgeinfer.api.http import error_handlers
from edgeinfer.api.tenants import TenantRegistry
from edgeinfer.router import routes, status_page
from edgeinfer.router.body_limit import BodyLimit
from edgeinfer.router.breaker import CircuitBreaker
from edgeinfer.router.bus import FleetBus
from edgeinfer.router.config import RouterConfig
from edgeinfer.router.fleet_file import Fleet
from edgeinfer.router.limits.tenants_check import tenants_digest
from edgeinfer.router.metrics import RouterMetrics
from edgeinfer.router.middleware import RequestIds
from edgeinfer.router.placement import PlacementLoop
from edgeinfer.router.proxy import Forwarder
from edgeinfer.router.service import RouterService
from edgeinfer.router.sources import PollSource
from edgeinfer.router.state import FleetState

logger = logging.getLogger("edgeinfer.router")
# Forwards go through this many independent connection pools, in turn (same limits in total): httpcore's
# pool walks all its connections (and, for each idle one, all of them again) on every request and every
# response, so one pool of N connections costs O(N^2) per request, which dominates a busy router
# (docs/benchmarks.md, router-latency, has what sharding bought).
POOL_SHARDS = 64


def create_router_app(config: RouterConfig, fleet: Fleet) -> FastAPI:
    if config.location not in fleet.rtt:
        raise ValueError(f"router location {config.location!r} is not a location of the fleet file")
    # The router's registry only checks keys; cache namespaces are derived on the nodes.
    namespace_key = secrets.token_bytes(32)
    table = load_table(config.tenants_file) if config.tenants_file else None
    if table is not None:
        tenants = TenantRegistry.from_mapping(table, namespace_key)
    else:
        tenants = TenantRegistry.open(namespace_key)
    state = FleetState(fleet, lambda: CircuitBreaker(config.breaker_failures, config.breaker_reset_s))
    metrics = RouterMetrics(lambda: [(v.entry.node_id, v.breaker.state) for v in state.nodes.values()])

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        timeout = httpx.Timeout(config.idle_timeout_s, connect=config.connect_timeout_s)
        limits = httpx.Limits(
            max_connections=4096 // POOL_SHARDS, max_keepalive_connections=512 // POOL_SHARDS
        )
        async with contextlib.AsyncExitStack() as stack:
            clients = [
                await stack.enter_async_context(httpx.AsyncClient(timeout=timeout, limits=limits))
                for _ in range(POOL_SHARDS)
            ]
            client = clients[0]  # status polls and placement requests
            bus = FleetBus(config, state, metrics, tenants_digest(table)) if config.nats_url else None
            source = bus if bus is not None else PollSource(state, client)
            await source.start()
            placement = None
            if config.placement is not None and config.router_secret is not None:
                placement = PlacementLoop(
                    state, client, config.router_secret, config.placement, config.policy
                )
            forwarder = Forwarder(config, state, clients, metrics)
            app.state.service = RouterService(
                config,
                tenants=tenants,
                state=state,
                forwarder=forwarder,
                metrics=metrics,
                placement=placement,
                limiter=bus.limiter if bus is not None else None,
            )
            if placement is not None:
                await placement.start()
            app.state.ready = True
            logger.info("router ready at %s; %d nodes in the fleet file", config.location, len(fleet.nodes))
            try:
                yield
            finally:
                app.state.ready = False
                if placement is not None:
                    await placement.stop()
                await source.stop()

    app = FastAPI(
        title="edgeinfer router",
        version=__version__,
        description="Routes OpenAI and Workers-AI requests to the best node of a fleet of locations.",
        lifespan=lifespan,
    )
    app.state.ready = False
    error_handlers.install(app)
    app.include_router(routes.router)
    app.include_router(status_page.router)
    app.add_middleware(BodyLimit, max_body_bytes=config.limits.max_body_bytes)
    app.add_middleware(RequestIds)  # the outermost: every answer has an id, errors of BodyLimit's too
    return app

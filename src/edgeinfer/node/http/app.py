"""The FastAPI application of one node: `create_app(config, pool)`."""

from __future__ import annotations

import asyncio
import gc
import logging
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from fastapi import FastAPI

from edgeinfer import __version__
from edgeinfer.api.files import load_table
from edgeinfer.api.http import error_handlers
from edgeinfer.api.tenants import TenantRegistry
from edgeinfer.engine.cache_dir import cache_root
from edgeinfer.node.billing.metering import UsageStore
from edgeinfer.node.billing.prices import PriceTable
from edgeinfer.node.billing.ratelimit import RateLimiter
from edgeinfer.node.config import NodeConfig
from edgeinfer.node.finetunes import NodeFinetunes
from edgeinfer.node.fleet_status import StatusPublisher
from edgeinfer.node.http import (
    openapi_schema,
    routes_embeddings,
    routes_finetunes,
    routes_openai,
    routes_ops,
    routes_workers_ai,
)
from edgeinfer.node.http.middleware import NodeMiddleware
from edgeinfer.node.service import NodeService
from edgeinfer.obs.metrics import EngineGauges, NodeMetrics
from edgeinfer.pool.manager import ModelPool

if TYPE_CHECKING:
    from edgeinfer.node.batch_worker import BatchWorker
    from edgeinfer.node.fleet_usage import UsagePublisher

logger = logging.getLogger("edgeinfer.node")
# At shutdown, how long the requests the server cancelled have to close (each awaits its engine's answer to
# its abort, about one step) before the models and the usage store are closed under them.
_SETTLE_S = 5.0


class _PoolMetrics:
    """Forwards pool load/evict events to the metrics."""

    def __init__(self, metrics: NodeMetrics) -> None:
        self._metrics = metrics

    def on_load(self, name: str, seconds: float, memory_bytes: int) -> None:
        self._metrics.model_loaded(name, seconds, memory_bytes)

    def on_evict(self, name: str, memory_bytes: int) -> None:
        self._metrics.model_evicted(name)


def engine_gauges(pool: ModelPool) -> dict[str, EngineGauges]:
    """Scrape-time state of every resident member (upstreams: read from their own metrics)."""
    gauges = {}
    for name, member in pool.residents().items():
        s = member.stats()
        gauges[name] = EngineGauges(
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            kv_usage=s.kv_usage,
            prefix_cache_queries=s.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits,
            num_preemptions=s.num_preemptions,
            cached_blocks_by_tenant=s.cached_blocks_by_tenant,
            evicted_blocks_by_tenant=s.evicted_blocks_by_tenant,
            spec_drafted_by_source=s.spec_drafted_by_source,
            spec_accepted_by_source=s.spec_accepted_by_source,
        )
    return gauges


def create_app(config: NodeConfig, pool: ModelPool) -> FastAPI:
    """Build the server around `pool`; the app owns it from then on (preloads it, shuts it down)."""
    secret = config.server_secret or secrets.token_bytes(32)
    if config.tenants_file:
        tenants = TenantRegistry.from_mapping(load_table(config.tenants_file), secret)
    else:
        tenants = TenantRegistry.open(secret)
    prices = PriceTable.from_mapping(load_table(config.prices_file)) if config.prices_file else PriceTable()
    metrics = NodeMetrics(engine_source=lambda: engine_gauges(pool))
    metrics.pool_budget_bytes.set(pool.budget_bytes or 0)
    pool.add_listener(_PoolMetrics(metrics))
    # A node on NATS queues every usage row as an event for the fleet ledger (docs/server.md, Fleet ledger).
    store = UsageStore(config.usage_db, node_id=config.node_id if config.nats_url else None)
    service = NodeService(
        limits=config.limits,
        pool=pool,
        tenants=tenants,
        limiter=RateLimiter(),
        store=store,
        prices=prices,
        metrics=metrics,
        stream_write_timeout_s=config.connections.stream_write_timeout_s,
        finetunes=NodeFinetunes(
            config.nats_url, Path(config.finetunes_dir), cache_root() / "finetunes", config.node_id
        ),
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        checkpoints = asyncio.create_task(service.checkpoint_usage(config.usage_checkpoint_s))
        publisher = StatusPublisher(config, pool, service.adapters.warm) if config.nats_url else None
        usage = _usage_publisher(store, config)
        batch = app.state.batch = _batch_worker(service, config)
        try:
            if usage is not None:
                await usage.start()  # first: events a crash left behind go out while models load
            await pool.preload(config.preload)
            if publisher is not None:
                await publisher.start()
            if batch is not None:
                await batch.start()  # after the preload: the first entries find their models warm
            # What exists now (modules, the preloaded models' objects) lives as long as the process: out of
            # the collector's sight, a full collection no longer walks it, which stalls the event loop and,
            # through the GIL, the engines' steps.
            gc.collect()
            gc.freeze()
            app.state.ready = True
            logger.info("node ready; models: %s", ", ".join(s.name for s in pool.states()))
            yield
        finally:
            app.state.ready = False
            if batch is not None:
                await batch.stop()  # first: its entries go back to the queue for other nodes at once
            await service.settle(_SETTLE_S)
            checkpoints.cancel()
            if publisher is not None:
                await publisher.stop()
            if usage is not None:
                await usage.stop()
            await pool.shutdown()
            await service.adapters.finetunes.close()
            await asyncio.to_thread(store.close)

    app = FastAPI(
        title="edgeinfer node",
        version=__version__,
        description="OpenAI and Workers-AI compatible inference: tenants, metering, a warm model pool.",
        lifespan=lifespan,
    )
    app.state.service = service
    app.state.node_config = config
    app.state.ready = False
    app.state.batch = None
    app.state.draining = False  # set by server.NodeServer when asked to stop
    error_handlers.install(app)
    for module in (routes_openai, routes_embeddings, routes_workers_ai, routes_finetunes, routes_ops):
        app.include_router(module.router)
    openapi_schema.install(app, open_node=config.tenants_file is None)
    app.add_middleware(
        NodeMiddleware,
        metrics=metrics,
        max_body_bytes=config.limits.max_body_bytes,
        body_timeout_s=config.connections.body_timeout_s,
    )
    return app


def _usage_publisher(store: UsageStore, config: NodeConfig) -> UsagePublisher | None:
    """The usage events' publisher of a node on NATS (None without): imported only then, so that a node
    without NATS does not load nats-py and aiohttp at its start."""
    if not config.nats_url:
        return None
    from edgeinfer.node.fleet_usage import UsagePublisher

    return UsagePublisher(store, config.nats_url, config.node_id)


def _batch_worker(service: NodeService, config: NodeConfig) -> BatchWorker | None:
    """The Batch API's side of a node on NATS (None without; imported only then, as the publisher)."""
    if not config.nats_url:
        return None
    from edgeinfer.node.batch_worker import BatchWorker

    return BatchWorker(service, config.nats_url, config.node_id, config.batch, config.batch_slots)

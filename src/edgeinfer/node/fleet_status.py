"""The node's side of the fleet bus: its `NodeStatus`, served on GET /node/status and published on NATS.

Publishing runs as one task in the server's event loop; a node whose loop is stuck therefore stops
publishing, and routers treat its last status as stale — the state they see is never fresher than the
node's ability to answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from edgeinfer.node.config import NodeConfig
from edgeinfer.pool.manager import ModelPool
from edgeinfer.pool.member import EMBED
from edgeinfer.types.status import STATUS_SUBJECT_PREFIX, NodeStatus

logger = logging.getLogger("edgeinfer.node")


def node_status(config: NodeConfig, pool: ModelPool, adapters_warm: tuple[str, ...] = ()) -> NodeStatus:
    """A snapshot of the pool: reads counters only (engine stats never wait for a model step);
    `adapters_warm`: the LoRA adapters its engines hold loaded (node/adapters.py)."""
    available: list[str] = []
    warm: list[str] = []
    loading: list[str] = []
    embedding: list[str] = []
    for state in pool.states():
        names = (state.name, *state.aliases)
        available.extend(names)
        if pool.task(state.name) == EMBED:  # read from the checkpoint's config once, then kept
            embedding.extend(names)
        if state.state == "resident":
            warm.extend(names)
        elif state.state == "loading":
            loading.extend(names)
    # Requests waiting for a model to load are queued too.
    waiting = sum(pool.waiting_for_load(state.name) for state in pool.states())
    running = capacity = 0
    kv_usage = 0.0
    for member in pool.residents().values():
        stats = member.stats()  # upstreams: their own gauges, as their metrics show them
        # Queued (batch-lane) work gives way to interactive requests: routers should not count it as load.
        running += stats.num_running - stats.num_running_batch
        waiting += stats.num_waiting - stats.num_waiting_batch
        capacity += stats.seats or 0
        kv_usage = max(kv_usage, stats.kv_usage or 0.0)
    return NodeStatus(
        node_id=config.node_id,
        location=config.location,
        models_available=tuple(available),
        models_warm=tuple(warm),
        models_loading=tuple(loading),
        models_embedding=tuple(embedding),
        adapters_warm=adapters_warm,
        queue_depth=waiting,
        running=running,
        kv_usage=round(kv_usage, 4),
        capacity=max(1, capacity),
        ts=time.time(),
    )


class StatusPublisher:
    """Publishes the node's status on `edgeinfer.status.<node_id>` every `interval_s` (nats-py)."""

    def __init__(
        self, config: NodeConfig, pool: ModelPool, adapters_warm: Callable[[], tuple[str, ...]]
    ) -> None:
        assert config.nats_url is not None
        self._config = config
        self._pool = pool
        self._adapters_warm = adapters_warm
        self._task: asyncio.Task[None] | None = None
        self._nc = None

    async def start(self) -> None:
        import nats

        self._nc = await nats.connect(
            self._config.nats_url, name=f"edgeinfer-node-{self._config.node_id}", max_reconnect_attempts=-1
        )
        self._task = asyncio.create_task(self._loop(), name="status-publisher")

    async def _loop(self) -> None:
        subject = f"{STATUS_SUBJECT_PREFIX}.{self._config.node_id}"
        while True:
            try:
                status = node_status(self._config, self._pool, self._adapters_warm())
                await self._nc.publish(subject, status.to_json())
            except Exception:  # a broker hiccup must not end publishing; nats-py reconnects by itself
                logger.exception("publishing node status failed")
            await asyncio.sleep(self._config.status_interval_s)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._nc is not None:
            with contextlib.suppress(Exception):
                await self._nc.drain()

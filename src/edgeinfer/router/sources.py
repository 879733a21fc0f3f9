"""Where fleet state comes from: NATS (any number of routers, nodes publish, no polling) or HTTP polling
of each node's GET /node/status (a static node list, no broker). Both feed `FleetState.update`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from edgeinfer.router.state import FleetState
from edgeinfer.router.upstream import NodeConnection, NodePool
from edgeinfer.types.status import STATUS_SUBJECT_PREFIX, NodeStatus

logger = logging.getLogger("edgeinfer.router")
POLL_TIMEOUT_S = 2.0
_STATUS_REQUEST = b"GET /node/status HTTP/1.1\r\nhost: %s\r\n\r\n"


class NatsSource:
    """Node statuses from NATS, on the router's connection (app.py owns it)."""

    def __init__(self, nc: Any, state: FleetState) -> None:
        self._nc = nc
        self._state = state
        self._sub: Any = None

    async def start(self) -> None:
        self._sub = await self._nc.subscribe(f"{STATUS_SUBJECT_PREFIX}.>", cb=self._on_message)

    async def _on_message(self, msg: Any) -> None:  # a nats.aio.msg.Msg
        try:
            self._state.update(NodeStatus.from_json(msg.data))
        except ValueError as exc:
            logger.warning("bad status on %s: %s", msg.subject, exc)

    async def stop(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()


class PollSource:
    """Polls every node every `interval_s` over the data plane's kept-alive connections to it (`pools`, the
    forwarder's, by node id): a poll costs the router's event loop tens of microseconds, not the near
    millisecond of a general HTTP client, during which requests would wait. A node that does not answer
    keeps its last status, which then ages into stale and dropped like a silent publisher's."""

    def __init__(self, state: FleetState, pools: dict[str, NodePool], interval_s: float = 0.1) -> None:
        self._state = state
        self._pools = pools
        self._interval_s = interval_s
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="status-poller")

    async def _loop(self) -> None:
        while True:
            node_ids = list(self._state.nodes)
            await asyncio.gather(*(self._poll(self._pools[node_id]) for node_id in node_ids))
            await asyncio.sleep(self._interval_s)

    async def _poll(self, pool: NodePool) -> None:
        node: NodeConnection | None = None
        try:
            # Up to the drop bound: a slow answer is still fresher than none.
            node = await pool.exchange(_STATUS_REQUEST % pool.host_header, POLL_TIMEOUT_S)
            body = await node.body()
            pool.release(node)
            if node.status == 200:
                self._state.update(NodeStatus.from_json(body))
        except (OSError, TimeoutError, ValueError):
            pass  # silence is the signal: the status ages
        finally:
            if node is not None and not node.complete:
                node.abort()  # cut short (a timeout, a cancel): never back in the pool

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

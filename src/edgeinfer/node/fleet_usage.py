"""The node's side of the fleet ledger: publishes the usage events queued in the store's outbox to JetStream.

Each event is published with `Nats-Msg-Id: <event_id>`, so JetStream stores a repeated publish once, and is
deleted from the outbox only after JetStream acknowledged it: an event is published at least once and never
lost by the node. While NATS is unreachable events wait on disk and publishing retries with a backoff, cut
short when the connection is back.

It runs as one task in the node's event loop on its own NATS connection, made in that task: a node whose
NATS is down starts and serves anyway.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import nats
from nats.aio.client import Client
from nats.js import JetStreamContext

from edgeinfer.api.usage_stream import ensure_stream, usage_stream_config
from edgeinfer.node.billing.metering import UsageStore

logger = logging.getLogger("edgeinfer.node")

# Events published concurrently and deleted in one statement.
BATCH = 256
# How long JetStream has to acknowledge a publish before the event is tried again.
PUBLISH_TIMEOUT_S = 5.0
RETRY_MIN_S = 0.5
RETRY_MAX_S = 30.0
# At shutdown, how long what is left in the outbox may take to go out (the rest waits for the next start).
FINAL_DRAIN_S = 2.0


class UsagePublisher:
    """Started by the node's lifespan when it has `--nats-url`, stopped at its end."""

    def __init__(self, store: UsageStore, nats_url: str, node_id: str) -> None:
        self._store = store
        self._nats_url = nats_url
        self._node_id = node_id
        self._wake = asyncio.Event()  # new events in the outbox
        self._reconnected = asyncio.Event()  # NATS is back: a retry need not wait out its backoff
        self._nc: Client | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        loop = asyncio.get_running_loop()

        def wake_soon() -> None:
            with contextlib.suppress(RuntimeError):  # the loop is closing: the next start publishes
                loop.call_soon_threadsafe(self._wake.set)

        self._wake.set()  # what an earlier run left in the outbox goes first
        self._store.watch_outbox(wake_soon)
        self._task = asyncio.create_task(self._run(), name="usage-publisher")
        self._task.add_done_callback(_report_end)

    async def stop(self) -> None:
        self._store.watch_outbox(None)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._nc is None:
            return
        if self._nc.is_connected:
            await asyncio.to_thread(self._store.flush)  # the final rows of requests ended by the shutdown
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._drain(self._nc.jetstream()), FINAL_DRAIN_S)
        with contextlib.suppress(Exception):
            await self._nc.close()

    async def _run(self) -> None:
        async def reconnected() -> None:
            self._reconnected.set()

        # Retries forever while NATS is down (max_reconnect_attempts=-1 covers the first connect too).
        self._nc = await nats.connect(
            self._nats_url,
            name=f"edgeinfer-node-{self._node_id}-usage",
            max_reconnect_attempts=-1,
            error_cb=_log_nats_error,
            reconnected_cb=reconnected,
        )
        js = self._nc.jetstream(timeout=PUBLISH_TIMEOUT_S)
        retry_s = RETRY_MIN_S
        stream_ready = False
        while True:
            await self._wake.wait()
            self._wake.clear()
            self._reconnected.clear()
            try:
                if not self._nc.is_connected:  # publishing now would only pile up in nats-py's buffer
                    raise ConnectionError("not connected to NATS")
                if not stream_ready:
                    await ensure_stream(js, usage_stream_config())
                    stream_ready = True
                await self._drain(js)
                retry_s = RETRY_MIN_S
            except Exception as exc:  # NATS down, restarting, or the stream deleted: the events wait on disk
                logger.warning("usage events wait on disk (%s); retrying in %.1f s", _describe(exc), retry_s)
                stream_ready = False
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._reconnected.wait(), retry_s)
                retry_s = min(RETRY_MAX_S, 2 * retry_s)
                self._wake.set()

    async def _drain(self, js: JetStreamContext) -> None:
        """Publish the outbox until it is empty; raises the first failure after deleting what was acked."""
        while entries := await asyncio.to_thread(self._store.outbox, BATCH):
            acks = await asyncio.gather(
                *(js.publish(e.subject, e.payload, headers={"Nats-Msg-Id": e.event_id}) for e in entries),
                return_exceptions=True,
            )
            done = [e.id for e, ack in zip(entries, acks, strict=True) if not isinstance(ack, BaseException)]
            await asyncio.to_thread(self._store.outbox_done, done)
            failure = next((ack for ack in acks if isinstance(ack, BaseException)), None)
            if failure is not None:
                raise failure


def _report_end(task: asyncio.Task[None]) -> None:
    """The publisher runs until the node stops; anything else ending it must not pass unseen."""
    if not task.cancelled() and task.exception() is not None:
        logger.error(
            "the usage publisher stopped; events wait in the outbox until the next start",
            exc_info=task.exception(),
        )


async def _log_nats_error(exc: Exception) -> None:
    """One line per error: nats-py's default logs a traceback for every failed reconnect."""
    logger.warning("usage publisher, NATS: %s", _describe(exc))


def _describe(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__

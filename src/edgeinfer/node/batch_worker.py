"""The node's side of the Batch API: submits and polls for its routes, and pulls queued entries for each of
its models while the model has room (no interactive request waiting, a seat free), running
them in the engine's batch lane, where interactive requests go first and preempt them.

An entry is acknowledged only after its result is stored, and the node tells JetStream it is still working
on it every third of the ack deadline: a node killed mid-entry stops telling, and the entry goes to another
node. At shutdown the entries in flight are handed back at once (nak)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import nats
from nats.aio.client import Client
from nats.aio.msg import Msg

from edgeinfer.api.embeddings import EmbeddingJob, workers_ai_embedding_job
from edgeinfer.api.errors import ApiError, unavailable
from edgeinfer.api.jobs import Job
from edgeinfer.api.prepare import workers_ai_job
from edgeinfer.api.schemas import WorkersAIRunRequest
from edgeinfer.batch.settings import BatchSettings
from edgeinfer.batch.store import WORKER_RENEW_S, BatchStore, WorkItem
from edgeinfer.node.service import NodeService
from edgeinfer.pool.member import EMBED
from edgeinfer.types.request import Lane

logger = logging.getLogger("edgeinfer.node")

# Answers that say "not now" (rate limits, a full queue, a model that cannot load yet): the entry is
# handed back and tried again after this long, on this node or another.
RETRY_AFTER_S = 2.0
_RETRYABLE = frozenset({429, 503, 500})
# How long a pull waits for an entry before the node looks at its room again.
PULL_WAIT_S = 1.0
# While a model has no room, how often the node looks again.
ROOM_POLL_S = 0.02


class BatchWorker:
    """Started by the node's lifespan when it has `--nats-url`, stopped at its end."""

    def __init__(
        self, service: NodeService, nats_url: str, node_id: str, settings: BatchSettings, slots: int | None
    ) -> None:
        """`slots`: entries of one model run at once on this node (None: one per engine seat; 0: none,
        the node only submits and polls)."""
        self._service = service
        self._nats_url = nats_url
        self._node_id = node_id
        self._settings = settings
        self._slots = slots
        self._nc: Client | None = None
        self._store: BatchStore | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._running: dict[asyncio.Task[None], Msg] = {}
        self._in_flight: dict[str, int] = {}

    async def start(self) -> None:
        task = asyncio.create_task(self._run(), name="batch-worker")
        task.add_done_callback(_report_end)
        self._tasks.append(task)

    async def stop(self) -> None:
        for task in [*self._tasks, *self._running]:
            task.cancel()
        await asyncio.gather(*self._tasks, *self._running, return_exceptions=True)
        if self._nc is not None:
            with contextlib.suppress(Exception):
                await self._nc.close()

    def store(self) -> BatchStore:
        """The queue, for the routes; 503 while NATS has not answered yet."""
        if self._store is None:
            raise unavailable("the batch queue is not reachable yet (NATS); retry shortly")
        return self._store

    async def _run(self) -> None:
        # Retries forever while NATS is down (max_reconnect_attempts=-1 covers the first connect too).
        self._nc = await nats.connect(
            self._nats_url, name=f"edgeinfer-node-{self._node_id}-batch", max_reconnect_attempts=-1
        )
        self._store = await BatchStore(self._nc.jetstream(), self._settings).open()
        pool = self._service.pool
        # A batch is queued under the name its client used: each alias has its own subject.
        names = pool.names()
        if self._slots != 0:
            pulls = [asyncio.create_task(self._pull(n, m), name=f"batch-pull-{n}") for n, m in names.items()]
            announce = asyncio.create_task(self._announce(list(names)), name="batch-announce")
            for task in pulls:
                task.add_done_callback(_report_end)
            self._tasks += [*pulls, announce]

    async def _announce(self, models: list[str]) -> None:
        assert self._store is not None
        while True:
            for model in models:
                with contextlib.suppress(Exception):  # NATS down: the key expires, polls say so
                    await self._store.announce(model, self._node_id)
            await asyncio.sleep(WORKER_RENEW_S)

    async def _pull(self, name: str, model: str) -> None:
        """Entries queued under `name` (the model `model` or an alias of it)."""
        assert self._store is not None
        sub = await self._store.pull(name)
        while True:
            await self._until_room(model)
            try:
                msgs = await sub.fetch(1, timeout=PULL_WAIT_S)
            except nats.errors.TimeoutError:
                continue
            except Exception as exc:  # NATS down or restarting: the consumer is durable, pull again
                logger.warning("batch queue for %s: %s", name, exc)
                await asyncio.sleep(RETRY_AFTER_S)
                continue
            for msg in msgs:
                self._in_flight[model] = self._in_flight.get(model, 0) + 1
                task = asyncio.create_task(self._entry(msg))
                self._running[task] = msg
                task.add_done_callback(lambda t, m=model: self._done(t, m))

    def _done(self, task: asyncio.Task[None], model: str) -> None:
        self._running.pop(task, None)
        self._in_flight[model] -= 1
        if not task.cancelled() and task.exception() is not None:
            logger.error("batch entry failed", exc_info=task.exception())

    async def _until_room(self, model: str) -> None:
        """Until the model can take one more entry without anyone interactive waiting for it."""
        while not self._has_room(model):
            await asyncio.sleep(ROOM_POLL_S)

    def _has_room(self, model: str) -> bool:
        in_flight = self._in_flight.get(model, 0)
        member = self._service.pool.residents().get(model)
        if member is None:
            return in_flight == 0  # not loaded: the first entry loads it
        load = member.stats()
        # At most a seat each (`slots`: fewer), and none while an interactive request waits for a seat.
        seats = [n for n in (self._slots, load.seats) if n is not None and n > 0]
        return in_flight < min(seats, default=1) and load.num_waiting == load.num_waiting_batch

    async def _entry(self, msg: Msg) -> None:
        assert self._store is not None
        try:
            item = WorkItem.decode(msg.data)
        except (ValueError, TypeError) as exc:  # not ours: never deliver it again
            logger.error("batch queue: dropping a message that is no entry (%s)", exc)
            await msg.term()
            return
        if await self._store.has_result(item):
            await msg.ack()  # done before, by a node that died before acknowledging
            return
        beat = asyncio.create_task(self._keep_claim(msg))
        try:
            await self._store.mark_running(item)
            result = await self._result(item, msg.metadata.num_delivered)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await msg.nak()  # the node is stopping: another takes it now
            raise
        finally:
            beat.cancel()
        if result is None:
            await msg.nak(delay=RETRY_AFTER_S)
            return
        await self._store.put_result(item, result)
        await msg.ack()

    async def _keep_claim(self, msg: Msg) -> None:
        while True:
            await asyncio.sleep(self._settings.ack_wait_s / 3)
            with contextlib.suppress(Exception):
                await msg.in_progress()

    async def _result(self, item: WorkItem, attempt: int) -> dict[str, Any] | None:
        """The entry's answer as the batch returns it; None: not now, try again later."""
        service = self._service
        try:
            tenant = service.tenants.by_name(item.tenant)
            body = WorkersAIRunRequest.model_validate(item.body)
            job: Job | EmbeddingJob
            if service.model_task(item.model) == EMBED:
                job = workers_ai_embedding_job(item.model, body, service.limits)
            else:
                job = workers_ai_job(item.model, body, item.body, service.limits)
            job.lane, job.endpoint = Lane.BATCH, "ai.run.batch"
            job.request_id = f"batch-{item.request_id}-{item.index}"
            if isinstance(job, EmbeddingJob):
                result = await service.embed_queued(tenant, job)
            else:
                result = await service.run_queued(tenant, job)
        except ApiError as exc:
            if exc.status in _RETRYABLE and attempt < self._settings.max_attempts:
                return None
            return _answer(item, None, [{"code": exc.wai_code, "message": exc.message}])
        return _answer(item, result, [])


def _report_end(task: asyncio.Task[None]) -> None:
    """Starting the worker failed (NATS without JetStream, ...): the node serves on without the queue."""
    if not task.cancelled() and task.exception() is not None:
        logger.error("the batch queue is off on this node", exc_info=task.exception())


def _answer(item: WorkItem, result: dict[str, Any] | None, errors: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "id": item.index,
        "result": result,
        "success": not errors,
        "errors": errors,
        "external_reference": item.external_reference,
    }

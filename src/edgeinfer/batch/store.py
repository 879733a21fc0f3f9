"""The batch queue on NATS JetStream, as nodes and routers both use it.

- Work: one message per entry on the work-queue stream EDGEINFER_BATCH, subject `edgeinfer.batch.work.<model
  token>`; every node that serves the model pulls from one durable consumer of that subject, so an entry goes
  to one node at a time; a node that dies holding it stops acknowledging, and JetStream hands the entry to
  another after the ack deadline. Entries are published with a message id, so a retried submit queues once.
- State: the key-value bucket `edgeinfer_batches` holds each batch's description (`<id>`), a marker once a
  node started on it (`<id>.running`) and one result per entry (`<id>.r.<index>`), written with create: the
  first result of an entry wins, so an entry that ran twice (its node was presumed dead) answers once. The
  bucket's age limit is the retention time: a batch and its results go together.
- Workers: `edgeinfer_batch_workers` holds `<model token>.<node>` while a node pulls for the model, so a poll
  can say that no node serves the batch's model (the batch then stays queued).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import re
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any

from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    KeyValueConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import BadRequestError, KeyNotFoundError, KeyWrongLastSequenceError, NotFoundError
from nats.js.kv import KeyValue

from edgeinfer.api.errors import ApiError
from edgeinfer.api.usage_stream import STREAM_NAME_IN_USE, ensure_stream
from edgeinfer.batch.settings import BatchSettings
from edgeinfer.batch.submission import Entry

logger = logging.getLogger("edgeinfer.batch")

WORK_STREAM = "EDGEINFER_BATCH"
WORK_PREFIX = "edgeinfer.batch.work"
BATCHES_BUCKET = "edgeinfer_batches"
WORKERS_BUCKET = "edgeinfer_batch_workers"
# A node renews its worker key this often; the key lives three times as long.
WORKER_RENEW_S = 5.0
_PUBLISH_AT_ONCE = 256
_KEY_CHARS = re.compile(r"[^-_=a-zA-Z0-9]")


@dataclass(frozen=True, kw_only=True)
class Batch:
    """A batch's description, as its key holds it."""

    request_id: str
    tenant: str
    model: str
    count: int
    created: float


@dataclass(frozen=True, kw_only=True)
class WorkItem:
    """One entry on the queue: what a node needs to run it without asking anyone."""

    request_id: str
    tenant: str
    model: str
    index: int
    body: dict[str, Any]
    external_reference: str | None = None

    def encode(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes) -> WorkItem:
        return cls(**json.loads(data))


def model_token(model: str) -> str:
    """A subject token (and consumer name) for a model name, which may hold '/', '.', '@'."""
    return hashlib.sha256(model.encode()).hexdigest()[:24]


def work_subject(model: str) -> str:
    return f"{WORK_PREFIX}.{model_token(model)}"


def not_found(request_id: str) -> ApiError:
    # The same answer for an id that never existed, has expired, or is another tenant's.
    return ApiError(
        404, f"no queued request {request_id!r} for this account", code="not_found", param="request_id"
    )


class BatchStore:
    """One connection's view of the queue; `open` creates what is missing."""

    def __init__(self, js: JetStreamContext, settings: BatchSettings) -> None:
        self.js = js
        self.settings = settings
        self._batches: KeyValue | None = None
        self._workers: KeyValue | None = None

    async def open(self) -> BatchStore:
        s = self.settings
        await ensure_stream(
            self.js,
            StreamConfig(
                name=WORK_STREAM,
                subjects=[f"{WORK_PREFIX}.>"],
                retention=RetentionPolicy.WORK_QUEUE,
                storage=StorageType.FILE,
                max_age=s.retention_s,
                duplicate_window=min(s.retention_s, 600.0),
            ),
        )
        self._batches = await self._bucket(
            KeyValueConfig(bucket=BATCHES_BUCKET, ttl=s.retention_s, storage=StorageType.FILE)
        )
        self._workers = await self._bucket(
            KeyValueConfig(bucket=WORKERS_BUCKET, ttl=3 * WORKER_RENEW_S, storage=StorageType.MEMORY)
        )
        return self

    async def _bucket(self, config: KeyValueConfig) -> KeyValue:
        """The bucket, created unless it exists; one that exists with other settings (another node's
        `--batch-retention`, an operator's) is used as it is."""
        try:
            return await self.js.create_key_value(config)
        except BadRequestError as exc:
            if exc.err_code != STREAM_NAME_IN_USE:
                raise
            logger.info("bucket %s exists with other settings; using it as it is", config.bucket)
            return await self.js.key_value(config.bucket)

    @property
    def batches(self) -> KeyValue:
        assert self._batches is not None, "open() first"
        return self._batches

    # --- submitting and polling (nodes and routers) ---

    async def submit(self, tenant: str, model: str, entries: list[Entry]) -> Batch:
        """Describe the batch, then queue its entries (all or, on failure, an error the caller answers)."""
        batch = Batch(
            request_id=str(uuid.uuid4()), tenant=tenant, model=model, count=len(entries), created=time.time()
        )
        await self.batches.put(batch.request_id, json.dumps(asdict(batch)).encode())
        subject = work_subject(model)
        for start in range(0, len(entries), _PUBLISH_AT_ONCE):
            await asyncio.gather(
                *(self._publish(subject, batch, e) for e in entries[start : start + _PUBLISH_AT_ONCE])
            )
        return batch

    async def _publish(self, subject: str, batch: Batch, entry: Entry) -> None:
        item = WorkItem(
            request_id=batch.request_id,
            tenant=batch.tenant,
            model=batch.model,
            index=entry.index,
            body=entry.body,
            external_reference=entry.external_reference,
        )
        msg_id = f"{batch.request_id}.{entry.index}"
        await self.js.publish(subject, item.encode(), stream=WORK_STREAM, headers={"Nats-Msg-Id": msg_id})

    async def batch(self, tenant: str, request_id: str) -> Batch:
        """The tenant's batch of that id; 404 for any other (never another tenant's)."""
        if not _KEY_CHARS.sub("", request_id) == request_id:
            raise not_found(request_id)
        try:
            entry = await self.batches.get(request_id)
        except (KeyNotFoundError, NotFoundError):
            raise not_found(request_id) from None
        batch = Batch(**json.loads(entry.value or b"{}"))
        if batch.tenant != tenant:
            raise not_found(request_id)
        return batch

    async def progress(self, batch: Batch) -> tuple[int, bool]:
        """How many entries have a result, and whether any node started on the batch."""
        keys = await self._keys(BATCHES_BUCKET, f"{batch.request_id}.>")
        running = f"{batch.request_id}.running" in keys
        return len(keys) - running, running

    async def results(self, batch: Batch) -> list[dict[str, Any]]:
        entries = await asyncio.gather(
            *(self.batches.get(_result_key(batch.request_id, i)) for i in range(batch.count))
        )
        return [json.loads(e.value or b"{}") for e in entries]

    async def serving(self, model: str) -> bool:
        """Whether some node pulls the model's entries now."""
        try:
            return bool(await self._keys(WORKERS_BUCKET, f"{model_token(model)}.>"))
        except NotFoundError:  # the bucket is gone (an operator removed it): nobody has announced since
            return False

    async def _keys(self, bucket: str, pattern: str) -> set[str]:
        """The bucket's keys matching `pattern`, counted by the server (its stream's subjects): no watch
        over the whole bucket, as nats-py's `keys()` does."""
        prefix = f"$KV.{bucket}."
        info = await self.js.stream_info(f"KV_{bucket}", subjects_filter=prefix + pattern)
        return {subject.removeprefix(prefix) for subject in info.state.subjects or {}}

    # --- running (nodes) ---

    async def pull(self, model: str) -> JetStreamContext.PullSubscription:
        """The model's shared consumer: every node serving the model pulls from it."""
        config = ConsumerConfig(
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=self.settings.ack_wait_s,
            max_deliver=-1,  # entries past max_attempts are answered with an error, never dropped
        )
        name = f"batch-{model_token(model)}"
        return await self.js.pull_subscribe(
            work_subject(model), durable=name, stream=WORK_STREAM, config=config
        )

    async def announce(self, model: str, node_id: str) -> None:
        assert self._workers is not None
        await self._workers.put(f"{model_token(model)}.{_KEY_CHARS.sub('_', node_id)}", b"")

    async def has_result(self, item: WorkItem) -> bool:
        try:
            await self.batches.get(_result_key(item.request_id, item.index))
        except (KeyNotFoundError, NotFoundError):
            return False
        return True

    async def mark_running(self, item: WorkItem) -> None:
        await self._create(f"{item.request_id}.running", b"")  # the batch's first entry to start sets it

    async def put_result(self, item: WorkItem, result: dict[str, Any]) -> None:
        """Store the entry's result unless it has one (the first result of an entry is its result)."""
        await self._create(_result_key(item.request_id, item.index), json.dumps(result).encode())

    async def _create(self, key: str, value: bytes) -> None:
        with contextlib.suppress(KeyWrongLastSequenceError):  # it exists: the first write stands
            await self.batches.create(key, value)


def _result_key(request_id: str, index: int) -> str:
    return f"{request_id}.r.{index}"

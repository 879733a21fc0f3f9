"""Append-only usage store (SQLite, WAL): one row per request, summed per tenant for /v1/usage.

Requests still running are checkpointed into `usage_in_flight` (one row each, replaced as they progress);
their final row replaces it in the same transaction. A store opened after a crash turns what is left in
`usage_in_flight` into usage rows with status `STATUS_INTERRUPTED`, so a `kill -9` loses at most the usage
of one checkpoint interval.

A store given a node id (a node on NATS) also queues each usage row as a `UsageEvent` for the fleet ledger:
into `usage_outbox`, in the same transaction as the row, so no committed row misses its event and no event
exists without its row. The node's publisher (`node/fleet_usage.py`) deletes an event only once JetStream has
acknowledged it; until then it waits on disk, across NATS outages and restarts of the node.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import sqlite3
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgeinfer.types.usage_event import UsageEvent

logger = logging.getLogger("edgeinfer.metering")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS usage (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    ts REAL NOT NULL,
    tenant TEXT NOT NULL,
    model TEXT NOT NULL,
    request_id TEXT NOT NULL,
    endpoint TEXT NOT NULL,
    status INTEGER NOT NULL,
    input_tokens INTEGER NOT NULL,
    cached_input_tokens INTEGER NOT NULL,
    output_tokens INTEGER NOT NULL,
    cost_units REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS usage_tenant_ts ON usage (tenant, ts);
CREATE TRIGGER IF NOT EXISTS usage_no_update BEFORE UPDATE ON usage
    BEGIN SELECT RAISE(ABORT, 'usage is append-only'); END;
CREATE TRIGGER IF NOT EXISTS usage_no_delete BEFORE DELETE ON usage
    BEGIN SELECT RAISE(ABORT, 'usage is append-only'); END;
CREATE TABLE IF NOT EXISTS usage_in_flight (
    request_id TEXT PRIMARY KEY,
    ts REAL NOT NULL,
    tenant TEXT NOT NULL,
    model TEXT NOT NULL,
    endpoint TEXT NOT NULL,
    status INTEGER NOT NULL,
    input_tokens INTEGER NOT NULL,
    cached_input_tokens INTEGER NOT NULL,
    output_tokens INTEGER NOT NULL,
    cost_units REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS usage_outbox (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    event_id TEXT NOT NULL,
    subject TEXT NOT NULL,
    event BLOB NOT NULL
);
"""
# The columns of the usage table (and of usage_in_flight), in their order: UsageRecord's fields but timings.
COLUMNS = (
    "ts",
    "tenant",
    "model",
    "request_id",
    "endpoint",
    "status",
    "input_tokens",
    "cached_input_tokens",
    "output_tokens",
    "cost_units",
)
_COLUMN_LIST = ", ".join(COLUMNS)
_PLACEHOLDERS = ", ".join("?" * len(COLUMNS))
# The status of a request the node stopped serving in the middle (a crash): billed to its last checkpoint.
STATUS_INTERRUPTED = 599
_FINAL, _CHECKPOINT = "final", "checkpoint"


@dataclass(frozen=True, kw_only=True)
class UsageRecord:
    """What one request consumed (an aborted request is billed for the tokens it did use)."""

    ts: float
    tenant: str
    model: str
    request_id: str
    endpoint: str
    status: int
    input_tokens: int
    cached_input_tokens: int
    output_tokens: int
    cost_units: float
    # For the fleet ledger's event only (the usage table keeps its columns): first token and whole time,
    # and the HTTP request's id (`x-request-id`), by which the router that admitted it settles its limits.
    ttft_ms: float | None = None
    duration_ms: float | None = None
    http_request_id: str | None = None

    @classmethod
    def from_row(cls, row: tuple[Any, ...]) -> UsageRecord:
        """A record from the usage table's columns, in their order."""
        return cls(**dict(zip(COLUMNS, row, strict=True)))

    def row(self) -> tuple[Any, ...]:
        """The values of the usage table's columns, in their order."""
        return tuple(getattr(self, name) for name in COLUMNS)

    def event(self, node_id: str) -> UsageEvent:
        """The ledger's event: every field of the record, and the node."""
        return UsageEvent(node_id=node_id, **dataclasses.asdict(self))


@dataclass(frozen=True)
class OutboxEntry:
    """One usage event waiting for JetStream's acknowledgement."""

    id: int
    event_id: str
    subject: str
    payload: bytes


class UsageStore:
    """Writes go through a queue to one writer thread, so the event loop never waits on the disk.

    `append` and `checkpoint` are non-blocking and safe from any thread (including code running while a
    request is being cancelled); `flush` waits until everything given so far is committed.

    With `node_id`, every usage row gets its event in `usage_outbox` (see the module's docstring); without
    it (a node not on NATS) nothing is queued, since nothing would ever take it.
    """

    def __init__(self, path: str, node_id: str | None = None) -> None:
        if path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._node_id = node_id
        self._on_outbox: Callable[[], None] | None = None
        self._conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._conn.execute("PRAGMA journal_mode=WAL")
        # NORMAL in WAL mode: a power cut may lose the last commits, never corrupt the file; a killed
        # process loses nothing that was committed.
        self._conn.execute("PRAGMA synchronous=NORMAL")
        self._conn.executescript(_SCHEMA)
        self._close_interrupted()
        self._lock = threading.Lock()
        self._queue: queue.Queue[tuple[str, UsageRecord] | None] = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="usage-writer", daemon=True)
        self._writer.start()

    def append(self, record: UsageRecord) -> None:
        """The final row of a request (it replaces the request's checkpoint)."""
        self._queue.put((_FINAL, record))

    def checkpoint(self, record: UsageRecord) -> None:
        """What a running request has used so far; replaces its previous checkpoint."""
        self._queue.put((_CHECKPOINT, record))

    def flush(self) -> None:
        self._queue.join()

    def close(self) -> None:
        self._queue.put(None)
        self._writer.join()
        self._conn.close()

    def summary(
        self, tenant: str, start: float | None = None, end: float | None = None
    ) -> list[dict[str, Any]]:
        """Per-model sums of the tenant's usage with `start <= ts < end` (unix seconds)."""
        sql = (
            "SELECT model, COUNT(*), SUM(input_tokens), SUM(cached_input_tokens), SUM(output_tokens), "
            "SUM(cost_units) FROM usage WHERE tenant = ? AND ts >= ? AND ts < ? GROUP BY model ORDER BY model"
        )
        with self._lock:
            rows = self._conn.execute(sql, (tenant, start or 0.0, end or float("inf"))).fetchall()
        keys = ("model", "requests", "input_tokens", "cached_input_tokens", "output_tokens", "cost_units")
        return [dict(zip(keys, row, strict=True)) for row in rows]

    def records(self, tenant: str, limit: int = 100) -> list[UsageRecord]:
        """The tenant's most recent rows, newest first."""
        sql = f"SELECT {_COLUMN_LIST} FROM usage WHERE tenant = ? ORDER BY id DESC LIMIT ?"
        with self._lock:
            rows = self._conn.execute(sql, (tenant, limit)).fetchall()
        return [UsageRecord.from_row(row) for row in rows]

    def watch_outbox(self, callback: Callable[[], None] | None) -> None:
        """Call `callback` (from the writer thread) after each commit that queued events; None stops it."""
        self._on_outbox = callback

    def outbox(self, limit: int) -> list[OutboxEntry]:
        """The oldest events still waiting to be published."""
        sql = "SELECT id, event_id, subject, event FROM usage_outbox ORDER BY id LIMIT ?"
        with self._lock:
            rows = self._conn.execute(sql, (limit,)).fetchall()
        return [OutboxEntry(*row) for row in rows]

    def outbox_done(self, ids: list[int]) -> None:
        """Forget these events: JetStream has them."""
        with self._lock:
            self._conn.executemany("DELETE FROM usage_outbox WHERE id = ?", [(i,) for i in ids])

    def _close_interrupted(self) -> None:
        """Rows of requests that were running when the previous process died become usage rows (and
        events), in one transaction with emptying `usage_in_flight`."""
        rows = self._conn.execute(f"SELECT {_COLUMN_LIST} FROM usage_in_flight ORDER BY ts").fetchall()
        records = [UsageRecord.from_row(row) for row in rows]
        with self._conn:
            self._conn.execute("BEGIN")
            for record in records:
                self._insert_final(dataclasses.replace(record, status=STATUS_INTERRUPTED))
            self._conn.execute("DELETE FROM usage_in_flight")
        if records:
            logger.warning(
                "%d requests were interrupted by a stop; billed to their last checkpoint", len(records)
            )

    def _insert_final(self, record: UsageRecord) -> None:
        """The request's usage row, its event for the ledger (on NATS), and no more checkpoint."""
        self._conn.execute(f"INSERT INTO usage ({_COLUMN_LIST}) VALUES ({_PLACEHOLDERS})", record.row())
        self._conn.execute("DELETE FROM usage_in_flight WHERE request_id = ?", (record.request_id,))
        if self._node_id is not None:
            event = record.event(self._node_id)
            self._conn.execute(
                "INSERT INTO usage_outbox (event_id, subject, event) VALUES (?, ?, ?)",
                (event.event_id, event.subject, event.to_json()),
            )

    def _insert_checkpoint(self, record: UsageRecord) -> None:
        sql = f"INSERT OR REPLACE INTO usage_in_flight ({_COLUMN_LIST}) VALUES ({_PLACEHOLDERS})"
        self._conn.execute(sql, record.row())

    def _write_loop(self) -> None:
        while True:
            batch = [self._queue.get()]
            while not self._queue.empty():
                batch.append(self._queue.get_nowait())
            ops = [op for op in batch if op is not None]
            try:
                if ops:
                    self._write(ops)
            finally:
                for _ in batch:
                    self._queue.task_done()
            if len(ops) < len(batch):
                return

    def _write(self, ops: list[tuple[str, UsageRecord]]) -> None:
        """One transaction, in order: a request's final row always follows its checkpoints."""
        with self._lock:
            try:
                self._conn.execute("BEGIN")
                for kind, record in ops:
                    if kind == _FINAL:
                        self._insert_final(record)
                    else:
                        self._insert_checkpoint(record)
                self._conn.execute("COMMIT")
            except sqlite3.Error:
                # Keep the writer alive: losing a batch is logged loudly, stopping metering would be worse.
                logger.exception("could not write %d usage records", len(ops))
                if self._conn.in_transaction:
                    self._conn.execute("ROLLBACK")
                return
        callback = self._on_outbox
        if callback is not None and any(kind == _FINAL for kind, _ in ops):
            callback()

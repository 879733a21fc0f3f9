"""Append-only usage store (SQLite, WAL): one row per request, summed per tenant for /v1/usage.

Requests still running are checkpointed into `usage_in_flight` (one row each, replaced as they progress);
their final row replaces it in the same transaction. A store opened after a crash turns what is left in
`usage_in_flight` into usage rows with status `STATUS_INTERRUPTED`, so a `kill -9` loses at most the usage
of one checkpoint interval.
"""

from __future__ import annotations

import logging
import queue
import sqlite3
import threading
from dataclasses import astuple, dataclass, fields
from pathlib import Path
from typing import Any

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
"""
_COLUMNS = (
    "ts, tenant, model, request_id, endpoint, status, "
    "input_tokens, cached_input_tokens, output_tokens, cost_units"
)
_PLACEHOLDERS = ", ".join("?" * 10)
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


class UsageStore:
    """Writes go through a queue to one writer thread, so the event loop never waits on the disk.

    `append` and `checkpoint` are non-blocking and safe from any thread (including code running while a
    request is being cancelled); `flush` waits until everything given so far is committed.
    """

    def __init__(self, path: str) -> None:
        if path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.path = path
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
        sql = f"SELECT {_COLUMNS} FROM usage WHERE tenant = ? ORDER BY id DESC LIMIT ?"
        with self._lock:
            rows = self._conn.execute(sql, (tenant, limit)).fetchall()
        names = [f.name for f in fields(UsageRecord)]
        return [UsageRecord(**dict(zip(names, row, strict=True))) for row in rows]

    def _close_interrupted(self) -> None:
        """Rows of requests that were running when the previous process died become usage rows."""
        status = f"{STATUS_INTERRUPTED} AS status"
        with self._conn:
            self._conn.execute("BEGIN")
            moved = self._conn.execute(
                f"INSERT INTO usage ({_COLUMNS}) SELECT {_COLUMNS.replace('status', status)} "
                "FROM usage_in_flight ORDER BY ts"
            ).rowcount
            self._conn.execute("DELETE FROM usage_in_flight")
        if moved:
            logger.warning("%d requests were interrupted by a stop; billed to their last checkpoint", moved)

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
                        self._conn.execute(
                            f"INSERT INTO usage ({_COLUMNS}) VALUES ({_PLACEHOLDERS})", astuple(record)
                        )
                        self._conn.execute(
                            "DELETE FROM usage_in_flight WHERE request_id = ?", (record.request_id,)
                        )
                    else:
                        self._conn.execute(
                            f"INSERT OR REPLACE INTO usage_in_flight ({_COLUMNS}) VALUES ({_PLACEHOLDERS})",
                            astuple(record),
                        )
                self._conn.execute("COMMIT")
            except sqlite3.Error:
                # Keep the writer alive: losing a batch is logged loudly, stopping metering would be worse.
                logger.exception("could not write %d usage records", len(ops))
                if self._conn.in_transaction:
                    self._conn.execute("ROLLBACK")

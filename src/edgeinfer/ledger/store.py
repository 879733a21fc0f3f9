"""Where the ledger keeps usage events: SQLite (one file, the default) or PostgreSQL (one database that
several ledgers may share).

One table, `usage_events`, keyed by `event_id`: an event inserted twice (a redelivery after a ledger died
before its ack, a node's publish repeated after JetStream's duplicate window) is stored once, so it is billed
once. Both stores run the same SQL but for the placeholder, and give the same per-model sums.
"""

from __future__ import annotations

import contextlib
import sqlite3
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from edgeinfer.types.usage_event import UsageEvent

# Types both databases know (SQLite reads them as INTEGER and REAL).
_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS usage_events (
    event_id TEXT PRIMARY KEY,
    node_id TEXT NOT NULL,
    request_id TEXT NOT NULL,
    tenant TEXT NOT NULL,
    model TEXT NOT NULL,
    endpoint TEXT NOT NULL,
    status INTEGER NOT NULL,
    input_tokens BIGINT NOT NULL,
    cached_input_tokens BIGINT NOT NULL,
    output_tokens BIGINT NOT NULL,
    cost_units DOUBLE PRECISION NOT NULL,
    ts DOUBLE PRECISION NOT NULL,
    ttft_ms DOUBLE PRECISION,
    duration_ms DOUBLE PRECISION
)""",
    "CREATE INDEX IF NOT EXISTS usage_events_tenant_ts ON usage_events (tenant, ts)",
)
_FIELDS = (
    "event_id",
    "node_id",
    "request_id",
    "tenant",
    "model",
    "endpoint",
    "status",
    "input_tokens",
    "cached_input_tokens",
    "output_tokens",
    "cost_units",
    "ts",
    "ttft_ms",
    "duration_ms",
)
# The keys of one model's sums, as the node's GET /v1/usage has them.
SUMMARY_KEYS = ("model", "requests", "input_tokens", "cached_input_tokens", "output_tokens", "cost_units")
# PostgreSQL sums BIGINTs into NUMERIC (Decimal in Python): cast back so both stores answer plain ints.
_SUMMARY = (
    "SELECT model, COUNT(*), CAST(SUM(input_tokens) AS BIGINT), CAST(SUM(cached_input_tokens) AS BIGINT), "
    "CAST(SUM(output_tokens) AS BIGINT), SUM(cost_units) FROM usage_events "
    "WHERE tenant = {p} AND ts >= {p} AND ts < {p} GROUP BY model"
)


class LedgerStore:
    """The SQL both stores share, over one DB-API connection that one lock serializes (the consumer writes
    and the query responder reads from worker threads). A connection that failed is dropped and made again
    by the next call, so a database server that restarts costs the batches of its downtime a retry."""

    def __init__(self, connect: Callable[[], Any], placeholder: str) -> None:
        self._connect = connect
        self._conn: Any = None
        self._lock = threading.Lock()
        marks = ", ".join([placeholder] * len(_FIELDS))
        self._insert = (
            f"INSERT INTO usage_events ({', '.join(_FIELDS)}) VALUES ({marks}) "
            "ON CONFLICT (event_id) DO NOTHING"
        )
        self._summary = _SUMMARY.format(p=placeholder)
        with self._transaction():  # a wrong path or URL fails at start, not at the first event
            pass

    def insert(self, events: Sequence[UsageEvent]) -> int:
        """Store the events not stored yet, in one transaction; returns how many were new."""
        rows = [tuple(getattr(event, name) for name in _FIELDS) for event in events]
        with self._transaction() as conn:
            cursor = conn.cursor()
            cursor.executemany(self._insert, rows)
        return cursor.rowcount

    def summary(self, tenant: str, start: float | None, end: float | None) -> list[dict[str, Any]]:
        """Per-model sums of the tenant's events with `start <= ts < end` (unix seconds), by model name."""
        bounds = (float("-inf") if start is None else start, float("inf") if end is None else end)
        with self._transaction() as conn:
            rows = conn.execute(self._summary, (tenant, *bounds)).fetchall()
        # Sorted here, not in SQL: PostgreSQL's collation may order names otherwise than SQLite's bytes.
        return [dict(zip(SUMMARY_KEYS, row, strict=True)) for row in sorted(rows)]

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    @contextmanager
    def _transaction(self) -> Iterator[Any]:
        """The connection (made, with the schema, if there is none), under the lock; committed after the
        block, or dropped (its transaction rolled back) if the block raised."""
        with self._lock:
            if self._conn is None:
                self._conn = self._connect()
                for statement in _SCHEMA:
                    self._conn.execute(statement)
            conn = self._conn
            try:
                yield conn
                conn.commit()
            except BaseException:
                self._conn = None
                with contextlib.suppress(Exception):
                    conn.close()
                raise


def open_sqlite(path: str) -> LedgerStore:
    Path(path).parent.mkdir(parents=True, exist_ok=True)

    def connect() -> sqlite3.Connection:
        conn = sqlite3.connect(path, check_same_thread=False)
        conn.execute("PRAGMA journal_mode=WAL")
        # FULL: a commit is on disk before the ledger acks its events, which JetStream then never redelivers.
        conn.execute("PRAGMA synchronous=FULL")
        return conn

    return LedgerStore(connect, "?")


def open_postgres(url: str) -> LedgerStore:
    import psycopg  # here: a ledger on SQLite never loads it

    def connect() -> psycopg.Connection:
        try:
            return psycopg.connect(url, connect_timeout=10)
        except psycopg.OperationalError as exc:  # an OSError: the CLI's one line, the consumer's retry
            raise ConnectionError(f"cannot connect to PostgreSQL: {' '.join(str(exc).split())}") from None

    return LedgerStore(connect, "%s")

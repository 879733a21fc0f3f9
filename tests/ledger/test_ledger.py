"""The fleet ledger stores every usage event once however often it is delivered, sets corrupt events aside
and goes on, and answers usage queries over NATS as a node's /v1/usage does. Real nats-server (JetStream),
real SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import nats
import psycopg
import pytest
from helpers.jetstream import JetStream
from helpers.postgres import PostgresCluster
from nats.aio.client import Client

from edgeinfer.api.usage_stream import ensure_stream, usage_stream_config
from edgeinfer.ledger.client import LedgerError, LedgerUnavailable, query_usage
from edgeinfer.ledger.service import DEAD_STREAM, DURABLE, Ledger
from edgeinfer.ledger.store import LedgerStore, open_postgres, open_sqlite
from edgeinfer.node.billing.metering import UsageRecord, UsageStore
from edgeinfer.types.usage_event import USAGE_STREAM, USAGE_SUBJECT_PREFIX, UsageEvent


def _event(request_id: str, **fields: object) -> UsageEvent:
    values: dict = dict(
        request_id=request_id,
        node_id="fra-1",
        tenant="acme",
        model="m-a",
        endpoint="completions",
        status=200,
        input_tokens=7,
        cached_input_tokens=2,
        output_tokens=5,
        cost_units=0.1,
        ts=1000.0,
    )
    return UsageEvent(**{**values, **fields})


# A mix for the sums: two tenants, each with four models whose names sort differently by collation.
MIXED = [
    _event(
        f"r{i}",
        node_id=f"node-{i % 3}",
        tenant=("acme", "bob")[i // 4 % 2],
        model=("m-a", "M-b", "z", "Ä")[i % 4],
        input_tokens=3 * i + 1,
        cached_input_tokens=i % 5,
        output_tokens=2**i % 97,
        cost_units=0.1 * i + 0.3,
        ts=1000.0 + i,
        ttft_ms=None if i % 3 else 12.5,
        duration_ms=float(i),
    )
    for i in range(40)
]
WINDOWS = [("acme", None, None), ("acme", 1005.0, 1020.0), ("bob", None, 1011.0), ("nobody", None, None)]


def test_an_event_is_stored_once_however_often_it_comes(store: LedgerStore) -> None:
    events = [_event(f"r{i}") for i in range(10)]
    assert store.insert(events) == 10
    assert store.insert([*events[:4], _event("r10"), _event("r10")]) == 1
    (row,) = store.summary("acme", None, None)
    assert (row["requests"], row["output_tokens"]) == (11, 55)


def _exact(row: dict) -> dict:
    return {k: v for k, v in row.items() if k != "cost_units"}


def test_sqlite_and_postgres_give_the_same_sums_as_the_node(tmp_path: Path, postgres_url: str) -> None:
    lite, post = open_sqlite(str(tmp_path / "ledger.sqlite")), open_postgres(postgres_url)
    node = UsageStore(str(tmp_path / "node.sqlite"))
    try:
        for store in (lite, post):
            store.insert(MIXED)
        for e in MIXED:
            node.append(UsageRecord(**{k: getattr(e, k) for k in UsageRecord.__dataclass_fields__}))
        node.flush()
        for tenant, start, end in WINDOWS:
            mine, theirs, node_rows = (s.summary(tenant, start, end) for s in (lite, post, node))
            assert [_exact(r) for r in mine] == [_exact(r) for r in theirs] == [_exact(r) for r in node_rows]
            assert [r["cost_units"] for r in mine] == pytest.approx([r["cost_units"] for r in node_rows])
            assert [r["cost_units"] for r in theirs] == pytest.approx([r["cost_units"] for r in node_rows])
            assert all(
                type(v) is int for r in theirs for k, v in r.items() if k not in ("model", "cost_units")
            )
    finally:
        for store in (lite, post, node):
            store.close()


def test_the_postgres_store_connects_again_after_its_server_restarts(
    postgres_cluster: PostgresCluster, postgres_url: str
) -> None:
    store = open_postgres(postgres_url)
    try:
        store.insert([_event("r1")])
        postgres_cluster.restart()
        with pytest.raises(psycopg.OperationalError):
            store.insert([_event("r2")])  # the batch in flight fails: the ledger gives it back to JetStream
        assert store.insert([_event("r2")]) == 1
        assert store.summary("acme", None, None)[0]["requests"] == 2
    finally:
        store.close()


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[JetStream]:
    server = JetStream(tmp_path).start()
    yield server
    server.stop()


@asynccontextmanager
async def _running_ledger(url: str, store: LedgerStore) -> AsyncIterator[Client]:
    """A ledger in this event loop; yields a connection of the test's own, once the ledger answers."""
    ledger_nc, nc = await nats.connect(url), await nats.connect(url)
    task = asyncio.create_task(Ledger(store, batch_size=8).run(ledger_nc))
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                await query_usage(nc, "nobody", None, None)
                break
            except LedgerUnavailable:
                assert time.monotonic() < deadline and not task.done(), "the ledger never answered"
                await asyncio.sleep(0.02)
        yield nc
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await ledger_nc.close()
        await nc.close()


async def _until_consumed(nc: Client, timeout: float = 10.0) -> None:
    """Until the ledger's consumer has nothing left to deliver and nothing unacknowledged."""
    js = nc.jetstream()
    deadline = time.monotonic() + timeout
    while True:
        info = await js.consumer_info(USAGE_STREAM, DURABLE)
        if info.num_pending == 0 and info.num_ack_pending == 0:
            return
        assert time.monotonic() < deadline, f"the ledger is stuck: {info}"
        await asyncio.sleep(0.05)


async def _publish(nc: Client, subject: str, payload: bytes, msg_id: str | None = None) -> None:
    js = nc.jetstream()
    await ensure_stream(js, usage_stream_config())
    await js.publish(subject, payload, headers={"Nats-Msg-Id": msg_id} if msg_id else None)


async def test_a_batch_delivered_again_after_its_commit_is_stored_once(
    nats_server: JetStream, store: LedgerStore
) -> None:
    events = [_event(f"r{i}") for i in range(20)]
    nc = await nats.connect(nats_server.url)
    try:
        for e in events:
            await _publish(nc, e.subject, e.to_json(), e.event_id)
            await _publish(nc, e.subject, e.to_json(), e.event_id)  # a node's retry: JetStream keeps one
        await _publish(nc, events[0].subject, events[0].to_json())  # a retry after the duplicate window
        # A ledger that committed a batch and died before acknowledging it: the server delivers it again.
        js = nc.jetstream()
        sub = await js.pull_subscribe(f"{USAGE_SUBJECT_PREFIX}.>", durable=DURABLE, stream=USAGE_STREAM)
        delivered = await sub.fetch(20, timeout=5)
        assert store.insert([UsageEvent.from_json(m.data) for m in delivered]) == 20
        for msg in delivered:
            await msg.nak()
        await sub.unsubscribe()
    finally:
        await nc.close()
    async with _running_ledger(nats_server.url, store) as nc:
        await _until_consumed(nc)
        (row,) = await query_usage(nc, "acme", None, None)
    assert (row["requests"], row["input_tokens"]) == (20, 140)


async def test_a_corrupt_event_is_set_aside_and_the_events_behind_it_are_stored(
    nats_server: JetStream, tmp_path: Path
) -> None:
    store = open_sqlite(str(tmp_path / "ledger.sqlite"))
    corrupt = [b"not json", b'{"request_id": "r9", "node_id": "fra-1"}']
    async with _running_ledger(nats_server.url, store) as nc:
        subject = f"{USAGE_SUBJECT_PREFIX}.fra-1"
        await _publish(nc, subject, _event("r1").to_json())
        for payload in corrupt:
            await _publish(nc, subject, payload)
        await _publish(nc, subject, _event("r2").to_json())
        await _until_consumed(nc)
        (row,) = await query_usage(nc, "acme", None, None)
        js = nc.jetstream()
        dead = [await js.get_msg(DEAD_STREAM, seq) for seq in (1, 2)]
        assert (await js.stream_info(DEAD_STREAM)).state.messages == 2
    store.close()
    assert row["requests"] == 2
    assert [m.data for m in dead] == corrupt
    assert {m.subject for m in dead} == {"edgeinfer.usage_dead.fra-1"}
    assert "not JSON" in dead[0].headers["Edgeinfer-Error"]
    assert "must be a non-empty string" in dead[1].headers["Edgeinfer-Error"]


async def test_usage_queries_over_nats_answer_per_model_totals(
    nats_server: JetStream, tmp_path: Path
) -> None:
    store = open_sqlite(str(tmp_path / "ledger.sqlite"))
    store.insert(MIXED)
    nc = await nats.connect(nats_server.url)
    try:
        with pytest.raises(LedgerUnavailable, match="no ledger is listening"):
            await query_usage(nc, "acme", None, None)
    finally:
        await nc.close()
    async with _running_ledger(nats_server.url, store) as nc:
        for tenant, start, end in WINDOWS:
            assert await query_usage(nc, tenant, start, end) == store.summary(tenant, start, end)
        rows = await query_usage(nc, "acme", None, None)
        with pytest.raises(LedgerError, match="needs a tenant"):
            await query_usage(nc, "", None, None)
        bad = await nc.request("edgeinfer.ledger.usage", b'{"tenant": "acme", "start": "yesterday"}')
    store.close()
    assert [r["model"] for r in rows] == ["M-b", "m-a", "z", "Ä"]
    assert sum(r["requests"] for r in rows) == 20
    assert b"start must be unix seconds" in bad.data

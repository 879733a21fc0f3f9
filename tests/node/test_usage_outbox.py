"""The node's half of the fleet ledger: every usage row gets its event in the outbox in the same transaction,
and the publisher empties the outbox into JetStream only as far as JetStream acknowledged it."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import time
from pathlib import Path

import nats
from helpers.jetstream import JetStream

from edgeinfer.node.billing.metering import STATUS_INTERRUPTED, UsageRecord, UsageStore
from edgeinfer.node.fleet_usage import UsagePublisher
from edgeinfer.types.usage_event import USAGE_STREAM, UsageEvent


def _record(request_id: str, output_tokens: int = 5, **fields: object) -> UsageRecord:
    values: dict = dict(
        ts=time.time(),
        tenant="acme",
        model="tiny",
        request_id=request_id,
        endpoint="completions",
        status=200,
        input_tokens=3,
        cached_input_tokens=1,
        output_tokens=output_tokens,
        cost_units=0.25,
    )
    return UsageRecord(**{**values, **fields})


def _rows(db: Path, sql: str) -> list[tuple]:
    with contextlib.closing(sqlite3.connect(db)) as conn:
        return conn.execute(sql).fetchall()


def test_a_usage_row_and_its_event_commit_together(tmp_path: Path) -> None:
    db = tmp_path / "usage.sqlite"
    store = UsageStore(str(db), node_id="fra-1")
    store.append(_record("r1", ttft_ms=12.5, duration_ms=40.0))
    store.flush()
    ((event_id, subject, payload),) = _rows(db, "SELECT event_id, subject, event FROM usage_outbox")
    event = UsageEvent.from_json(payload)
    assert (event_id, subject) == ("fra-1/r1", "edgeinfer.usage.fra-1") == (event.event_id, event.subject)
    assert (event.output_tokens, event.cost_units, event.ttft_ms, event.duration_ms) == (5, 0.25, 12.5, 40.0)
    # An outbox that refuses the event takes the usage row down with it: one transaction, never one of two.
    with contextlib.closing(sqlite3.connect(db)) as conn:
        conn.execute(
            "CREATE TRIGGER full BEFORE INSERT ON usage_outbox BEGIN SELECT RAISE(ABORT, 'full'); END"
        )
        conn.commit()
    store.append(_record("r2"))
    store.flush()
    store.close()
    assert _rows(db, "SELECT request_id FROM usage") == [("r1",)]


def test_requests_cut_off_by_a_crash_are_billed_and_queued_at_the_next_start(tmp_path: Path) -> None:
    db = str(tmp_path / "usage.sqlite")
    store = UsageStore(db, node_id="fra-1")
    store.checkpoint(_record("running", output_tokens=17))
    store.flush()
    store.close()  # as after a kill -9: the checkpoint is all there is
    UsageStore(db, node_id="fra-1").close()
    ((payload,),) = _rows(Path(db), "SELECT event FROM usage_outbox")
    event = UsageEvent.from_json(payload)
    assert (event.request_id, event.status, event.output_tokens) == ("running", STATUS_INTERRUPTED, 17)
    assert _rows(Path(db), "SELECT status, output_tokens FROM usage") == [(STATUS_INTERRUPTED, 17)]


def test_a_node_without_nats_queues_nothing(tmp_path: Path) -> None:
    db = tmp_path / "usage.sqlite"
    store = UsageStore(str(db))
    store.append(_record("r1"))
    store.close()
    assert _rows(db, "SELECT COUNT(*) FROM usage") == [(1,)]
    assert _rows(db, "SELECT COUNT(*) FROM usage_outbox") == [(0,)]


async def _stream_events(url: str) -> list[tuple[str, UsageEvent]]:
    """Every message of the usage stream: its Nats-Msg-Id and event."""
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        count = (await js.stream_info(USAGE_STREAM)).state.messages
        msgs = [await js.get_msg(USAGE_STREAM, seq) for seq in range(1, count + 1)]
        return [(m.headers["Nats-Msg-Id"], UsageEvent.from_json(m.data)) for m in msgs]
    finally:
        await nc.close()


async def _until_outbox_empty(store: UsageStore, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while await asyncio.to_thread(store.outbox, 1):
        assert time.monotonic() < deadline, "the outbox was not drained"
        await asyncio.sleep(0.05)


async def _delete_stream(url: str) -> None:
    nc = await nats.connect(url)
    try:
        await nc.jetstream().delete_stream(USAGE_STREAM)
    finally:
        await nc.close()


async def _append(store: UsageStore, *request_ids: str) -> None:
    for request_id in request_ids:
        store.append(_record(request_id))
    await asyncio.to_thread(store.flush)


async def test_events_wait_on_disk_while_nats_is_down_and_go_out_once_when_it_is_back(tmp_path: Path) -> None:
    server = JetStream(tmp_path)  # not started yet: the node comes up before its NATS
    store = UsageStore(str(tmp_path / "usage.sqlite"), node_id="fra-1")
    publisher = UsagePublisher(store, server.url, "fra-1")
    await publisher.start()
    try:
        await _append(store, *(f"r{i}" for i in range(300)))  # more than one batch
        await asyncio.sleep(0.5)
        assert len(await asyncio.to_thread(store.outbox, 1000)) == 300  # nothing acked, nothing dropped
        server.start()
        await _until_outbox_empty(store)
        server.kill()  # and once more while it is down
        await _append(store, "late")
        server.start()
        await _until_outbox_empty(store)
        published = await _stream_events(server.url)
        await _delete_stream(server.url)  # as a NATS started afresh on an empty store: made again
        await _append(store, "after")
        await _until_outbox_empty(store)
        remade = await _stream_events(server.url)
    finally:
        await publisher.stop()
        store.close()
        server.stop()
    assert sorted(msg_id for msg_id, _ in published) == sorted(
        [*(f"fra-1/r{i}" for i in range(300)), "fra-1/late"]
    )
    assert all(msg_id == event.event_id for msg_id, event in published)
    assert [msg_id for msg_id, _ in remade] == ["fra-1/after"]

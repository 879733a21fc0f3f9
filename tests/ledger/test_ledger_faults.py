"""The fleet ledger under faults, with real processes: a node (`--nats-url`) killed with -9 in the middle of a
stream and started again, the NATS server killed and started again under load, and `edgeinfer ledger`. After
all of it the ledger holds exactly the node's own usage rows, request by request: completed requests as their
clients saw them (the answers' usage), the interrupted one as the node's 599 row, none twice."""

from __future__ import annotations

import contextlib
import json
import sqlite3
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from helpers.jetstream import JetStream
from helpers.ledger_fleet import LedgerProc
from helpers.router_fleet import NodeProc, free_port
from helpers.tiny_models import make_tiny

from edgeinfer.node.billing.metering import STATUS_INTERRUPTED

_COMPARED = "status, tenant, model, ts, input_tokens, cached_input_tokens, output_tokens, cost_units"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A long context, so that one stream runs long enough to be killed in its middle."""
    return str(
        make_tiny("llama", tmp_path_factory.mktemp("ledger-tiny") / "llama", max_position_embeddings=4096)
    )


def _read(db: Path, sql: str) -> list[tuple]:
    """Read a database another process is writing (WAL: readers never block it)."""
    with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)) as conn:
        return conn.execute(sql).fetchall()


def _complete(url: str, max_tokens: int = 8) -> tuple[str, tuple[int, int]]:
    """A completed request: its id and the (prompt, completion) tokens its answer reported."""
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": max_tokens, "ignore_eos": True}
    answer = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert answer.status_code == 200
    usage = answer.json()["usage"]
    return answer.json()["id"], (usage["prompt_tokens"], usage["completion_tokens"])


def _kill_mid_stream(node: NodeProc, db: Path, tokens: int = 20) -> None:
    """SIGKILL the node while it streams, once a checkpoint holds at least `tokens` of the stream."""
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 3000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", node.url + "/v1/completions", json=body, timeout=60) as stream:
        lines = stream.iter_lines()  # held open: a closed stream would end the request (status 499)
        seen = 0
        while seen < tokens:
            line = next(lines)
            seen += line.startswith("data: {") and bool(json.loads(line[6:])["choices"])
        deadline = time.monotonic() + 30
        while not _read(db, f"SELECT 1 FROM usage_in_flight WHERE output_tokens >= {tokens}"):
            assert time.monotonic() < deadline, "no checkpoint of the stream"
            time.sleep(0.05)
        node.kill()


def _until_rows(db: Path, count: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while _read(db, "SELECT COUNT(*) FROM usage")[0][0] < count:
        assert time.monotonic() < deadline, f"fewer than {count} usage rows"
        time.sleep(0.02)


def _until_the_ledger_has_the_node_rows(node_db: Path, ledger_db: Path, timeout: float = 30.0) -> dict:
    """The node's usage rows by request id, once the ledger holds exactly those (same values, none more)."""
    deadline = time.monotonic() + timeout
    while True:
        node = {r[0]: r[1:] for r in _read(node_db, f"SELECT request_id, {_COMPARED} FROM usage")}
        ledger = (
            _read(ledger_db, f"SELECT request_id, {_COMPARED} FROM usage_events")
            if ledger_db.exists()
            else []
        )
        if {r[0]: r[1:] for r in ledger} == node and len(ledger) == len(node):
            return node
        assert time.monotonic() < deadline, f"node {len(node)} rows, ledger {len(ledger)}"
        time.sleep(0.1)


@pytest.mark.timeout(240)
def test_a_killed_node_and_a_restarted_nats_lose_nothing_and_bill_nothing_twice(
    tmp_path: Path, tiny_dir: str
) -> None:
    server = JetStream(tmp_path).start()
    ledger_db = tmp_path / "ledger.sqlite"
    ledger = LedgerProc(tmp_path, server.url, ["--db", str(ledger_db)]).start()
    node_db = tmp_path / "fra-1.sqlite"
    args = ["--model", f"tiny={tiny_dir}", "--preload", "--dtype", "float32", "--kv-cache-memory", "1MiB"]
    args += ["--batch-window-ms", "0", "--max-num-seqs", "1", "--usage-checkpoint-interval", "0.2"]
    args += ["--node-id", "fra-1", "--nats-url", server.url, "--usage-db", str(node_db), "--no-access-log"]
    node = NodeProc("fra-1", "FRA", free_port(), args, tmp_path / "fra-1.log")
    try:
        node.start()
        node.wait_ready()
        seen = dict(_complete(node.url) for _ in range(3))
        server.kill()
        with ThreadPoolExecutor(1) as load:  # requests go on while NATS is down, and while it comes back
            done = load.submit(lambda: [_complete(node.url, 24) for _ in range(6)])
            _until_rows(node_db, 3 + 3)
            server.start()
            seen |= dict(done.result())
        _kill_mid_stream(node, node_db)
        node.start()
        node.wait_ready()
        seen |= dict(_complete(node.url) for _ in range(2))
        _until_rows(node_db, 3 + 6 + 1 + 2)  # a response may leave before its row is committed
        billed = _until_the_ledger_has_the_node_rows(node_db, ledger_db)
        timings = _read(ledger_db, "SELECT status, ttft_ms, duration_ms FROM usage_events")
        assert not _read(node_db, "SELECT 1 FROM usage_outbox")
    finally:
        node.stop()
        ledger.stop()
        server.stop()
    statuses = sorted(row[0] for row in billed.values())
    assert statuses == [200] * 11 + [STATUS_INTERRUPTED], billed
    # each completed request billed as its client saw it (columns: input tokens 5th, output tokens 7th)
    assert {rid: (billed[rid][4], billed[rid][6]) for rid in seen} == seen
    (interrupted,) = [row for row in billed.values() if row[0] == STATUS_INTERRUPTED]
    assert 20 <= interrupted[6] < 3000
    assert all(ttft is not None and duration > 0 for status, ttft, duration in timings if status == 200)

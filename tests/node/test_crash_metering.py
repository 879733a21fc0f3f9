"""Metering survives a crash: tokens streamed before a `kill -9` are billed (to the last checkpoint), once."""

from __future__ import annotations

import contextlib
import json
import signal
import sqlite3
import time
from pathlib import Path

import httpx
from helpers.node_servers import NodeProcesses

from edgeinfer.node.billing.metering import STATUS_INTERRUPTED, UsageStore


def _until_checkpointed(db: Path, tokens: int, timeout_s: float = 60.0) -> None:
    """Poll the node's database (read-only) until a request in flight is checkpointed at >= `tokens`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)) as conn:
            try:
                (most,) = conn.execute("SELECT MAX(output_tokens) FROM usage_in_flight").fetchone()
            except sqlite3.OperationalError:  # locked by the writer, or not created yet
                most = None
        if most is not None and most >= tokens:
            return
        time.sleep(0.05)
    raise AssertionError(f"no checkpoint of {tokens} tokens within {timeout_s} s")


def test_kill_9_bills_the_streams_in_flight(tmp_path, tiny_llama_dir) -> None:
    procs = NodeProcesses(tmp_path)
    url = procs.start(
        *(
            "--model",
            f"tiny={tiny_llama_dir}",
            "--preload",
            "--dtype",
            "float32",
            "--kv-cache-memory",
            "256KiB",
        ),
        *("--batch-window-ms", "0", "--max-num-seqs", "1", "--usage-checkpoint-interval", "0.25"),
    )
    proc = procs.procs[0]
    try:
        first = {"model": "tiny", "prompt": "Hi", "max_tokens": 60, "ignore_eos": True}  # exactly 60 tokens
        done = httpx.post(url + "/v1/completions", json=first, timeout=60)
        assert done.status_code == 200
        # 8 choices one after the other (one seat): seconds of work, killed early on
        body = {
            "model": "tiny",
            "prompt": "Hello",
            "max_tokens": 480,
            "ignore_eos": True,
            "n": 8,
            "stream": True,
        }
        seen = 0
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as stream:
            lines = stream.iter_lines()  # held, not closed: closing it would hang up (status 499)
            while seen < 100:
                line = next(lines)
                seen += line.startswith("data: {") and bool(json.loads(line[6:])["choices"])
            _until_checkpointed(next(tmp_path.glob("proc-*.sqlite")), 100)
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
    finally:
        procs.stop()
    store = UsageStore(str(next(tmp_path.glob("proc-*.sqlite"))))  # what a restarted node does first
    try:
        rows = sorted(store.records("default"), key=lambda r: r.ts)
    finally:
        store.close()
    assert [r.status for r in rows] == [200, STATUS_INTERRUPTED]  # the finished one is not billed twice
    assert rows[0].output_tokens == 60
    assert 100 <= rows[1].output_tokens < 8 * 480 and rows[1].input_tokens > 0

"""Usage events per second into the fleet ledger (`edgeinfer ledger`) with its SQLite and PostgreSQL stores.

A NATS server (JetStream, file storage) and a ledger process on loopback, as `edgeinfer fleet up` runs them.
Two runs per store:

- live: the ledger is running and idle; N events are published to the usage stream (each acknowledged by
  JetStream, with its Nats-Msg-Id, as nodes publish them), and the clock runs from the first publish until
  the ledger has committed the last one;
- backlog: the N events are in the stream before the ledger starts (a ledger coming back after an outage);
  the clock runs from when the ledger answers its first query until it has committed the last one.

Commits are durable in both stores: SQLite with synchronous=FULL (the ledger's setting), PostgreSQL a
throwaway cluster (tests/helpers/postgres.py) with its defaults (fsync on, synchronous_commit on). Progress is
read from the store itself (a read-only count every 20 ms).

    .venv/bin/python bench/ledger_throughput.py [--events 20000] [--batch-size 256] [--write-docs]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import os
import platform
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import nats

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT / "tests")]
from docs_table import replace_section  # noqa: E402
from helpers.jetstream import JetStream  # noqa: E402
from helpers.ledger_fleet import LedgerProc  # noqa: E402
from helpers.postgres import fresh_database, throwaway_postgres  # noqa: E402

from edgeinfer.api.usage_stream import ensure_stream, usage_stream_config  # noqa: E402
from edgeinfer.fleet.nats_server import nats_server_binary  # noqa: E402
from edgeinfer.types.usage_event import UsageEvent  # noqa: E402

SECTION = "ledger-throughput"
# A store: workdir → (the ledger's store arguments, a count of the events it has committed).
Store = Callable[[Path], tuple[list[str], Callable[[], int]]]
# Publishes in flight at once (nats-py's asynchronous JetStream publish, acknowledged in windows).
WINDOW = 1000


@dataclass(frozen=True)
class Row:
    store: str
    mode: str
    events: int
    publish_s: float | None  # live runs only: until JetStream acknowledged the last publish
    committed_s: float
    # Events committed within committed_s: a backlog run's clock starts once the ledger answers, by when it
    # may have committed a first batch or two.
    timed: int

    @property
    def rate(self) -> float:
        return self.timed / self.committed_s


def _events(count: int, run: str) -> list[UsageEvent]:
    return [
        UsageEvent(
            request_id=f"{run}-{i}",
            node_id=f"node-{i % 300}",
            tenant=f"tenant-{i % 50}",
            model=("gemma-3-270m", "llama-3.1-8b", "qwen3-0.6b")[i % 3],
            endpoint="chat.completions",
            status=200,
            input_tokens=100 + i % 900,
            cached_input_tokens=i % 64,
            output_tokens=1 + i % 500,
            cost_units=0.01 * (i % 97),
            ts=time.time(),
            ttft_ms=25.0,
            duration_ms=800.0,
        )
        for i in range(count)
    ]


async def _publish(url: str, events: list[UsageEvent]) -> float:
    """Publish every event, acknowledged; returns the seconds it took."""
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        await ensure_stream(js, usage_stream_config())
        started = time.perf_counter()
        for first in range(0, len(events), WINDOW):
            acks = [
                await js.publish_async(e.subject, e.to_json(), headers={"Nats-Msg-Id": e.event_id})
                for e in events[first : first + WINDOW]
            ]
            await asyncio.gather(*acks)
        return time.perf_counter() - started
    finally:
        await nc.close()


def _until(count: Callable[[], int], target: int, started: float, timeout: float = 600.0) -> float:
    """Seconds from `started` (perf_counter) until `count()` reaches `target`."""
    while count() < target:
        if time.perf_counter() - started > timeout:
            raise RuntimeError(f"the ledger stored {count()} of {target} events in {timeout:g} s")
        time.sleep(0.02)
    return time.perf_counter() - started


def sqlite_store(workdir: Path) -> tuple[list[str], Callable[[], int]]:
    db = workdir / "ledger.sqlite"

    def count() -> int:
        try:
            with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)) as conn:
                return conn.execute("SELECT COUNT(*) FROM usage_events").fetchone()[0]
        except sqlite3.OperationalError:  # not created yet
            return 0

    return ["--db", str(db)], count


def postgres_store(cluster: str, workdir: Path) -> tuple[list[str], Callable[[], int]]:
    import psycopg

    url = fresh_database(cluster)
    conn = psycopg.connect(url, autocommit=True)

    def count() -> int:
        try:
            return conn.execute("SELECT COUNT(*) FROM usage_events").fetchone()[0]
        except psycopg.errors.UndefinedTable:  # not created yet
            return 0

    return ["--postgres-url", url], count


def run(name: str, store: Store, mode: str, events: int, batch_size: int) -> Row:
    """One measurement on a fresh NATS server and a fresh store."""
    with tempfile.TemporaryDirectory(prefix="ledger-bench-") as tmp:
        workdir = Path(tmp)
        server = JetStream(workdir).start()
        store_args, count = store(workdir)
        ledger = LedgerProc(workdir, server.url, [*store_args, "--batch-size", str(batch_size)])
        batch = _events(events, mode)
        try:
            if mode == "live":
                ledger.start()
                started = time.perf_counter()
                publish_s = asyncio.run(_publish(server.url, batch))
                return Row(name, mode, events, publish_s, _until(count, events, started), events)
            asyncio.run(_publish(server.url, batch))
            ledger.start()
            started, before = time.perf_counter(), count()
            return Row(name, mode, events, None, _until(count, events, started), events - before)
        finally:
            ledger.stop()
            server.stop()


def machine() -> str:
    """The CPU's model and a few of its flags (/proc/cpuinfo), the CPU count, the kernel and Python."""
    info = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []
    cpu = next(
        (ln.split(":", 1)[1].strip() for ln in info if ln.startswith("model name")), platform.processor()
    )
    flags = next((ln.split(":", 1)[1].split() for ln in info if ln.startswith("flags")), [])
    shown = " ".join(f for f in ("sse4_2", "avx2", "avx512f", "aes", "sha_ni") if f in flags) or "none listed"
    return (
        f"{cpu} (flags incl. {shown}), {os.cpu_count()} CPUs, Linux {platform.release()}, "
        f"Python {platform.python_version()}"
    )


def versions(cluster: str) -> str:
    import psycopg

    nats_server = subprocess.run([nats_server_binary(), "--version"], capture_output=True, text=True).stdout
    with psycopg.connect(cluster) as conn:
        postgres = conn.execute("SHOW server_version").fetchone()[0]
    return (
        f"{nats_server.strip()}, SQLite {sqlite3.sqlite_version}, PostgreSQL {postgres.split()[0]}, "
        f"psycopg {psycopg.__version__}"
    )


def table(rows: list[Row], args: argparse.Namespace, software: str, load: tuple[float, float]) -> str:
    command = (
        f".venv/bin/python bench/ledger_throughput.py --events {args.events} --batch-size {args.batch_size}"
    )
    lines = [
        "### Fleet ledger: usage events per second",
        "",
        f"Machine: {machine()}; {software}. 1-min load average {load[0]:.2f} before, {load[1]:.2f} after "
        "(NATS, the ledger and the publisher share the machine's cores).",
        f"Command: `{command} --write-docs`",
        "",
        "live: the ledger idle, then N events published (each acknowledged by JetStream, with its "
        "Nats-Msg-Id, as nodes publish); time from the first publish until the ledger committed the last. "
        "backlog: the N events already in the stream when the ledger starts; time from its first answer to "
        "a query until it committed the last (events/s counts those committed in that time). Commits are "
        "durable (SQLite synchronous=FULL; PostgreSQL with "
        "fsync and synchronous_commit on).",
        "",
        "| store | run | events | publish (s) | committed (s) | events/s |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        publish = "–" if r.publish_s is None else f"{r.publish_s:.2f}"
        lines.append(
            f"| {r.store} | {r.mode} | {r.events:,} | {publish} | {r.committed_s:.2f} | {r.rate:,.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=20000)
    ap.add_argument("--batch-size", type=int, default=256, help="the ledger's --batch-size")
    ap.add_argument(
        "--write-docs", action="store_true", help=f"replace the {SECTION} section of docs/benchmarks.md"
    )
    args = ap.parse_args()
    load_before = os.getloadavg()[0]
    rows = []
    with throwaway_postgres(fsync=True) as cluster:
        software = versions(cluster.url)
        stores: dict[str, Store] = {
            "SQLite": sqlite_store,
            "PostgreSQL": functools.partial(postgres_store, cluster.url),
        }
        for name, store in stores.items():
            for mode in ("live", "backlog"):
                rows.append(run(name, store, mode, args.events, args.batch_size))
                print(rows[-1], flush=True)
    body = table(rows, args, software, (load_before, os.getloadavg()[0]))
    print(body)
    if args.write_docs:
        replace_section(ROOT / "docs" / "benchmarks.md", SECTION, body)


if __name__ == "__main__":
    main()

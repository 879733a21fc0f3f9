"""`edgeinfer ledger`: the fleet's usage ledger (docs/server.md, Fleet ledger)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
from pathlib import Path

import nats

from edgeinfer.ledger.service import Ledger
from edgeinfer.ledger.store import open_postgres, open_sqlite

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"
DEFAULT_BATCH_SIZE = 256
logger = logging.getLogger("edgeinfer.ledger")


def default_ledger_db() -> str:
    """`$XDG_STATE_HOME/edgeinfer/ledger.sqlite` (default `~/.local/state/...`), beside a node's usage db."""
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return str(Path(state) / "edgeinfer" / "ledger.sqlite")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--nats-url", default=DEFAULT_NATS_URL, metavar="URL", help=f"the fleet's NATS ({DEFAULT_NATS_URL})"
    )
    store = parser.add_mutually_exclusive_group()
    store.add_argument("--db", default=None, metavar="PATH", help=f"SQLite store ({default_ledger_db()})")
    store.add_argument(
        "--postgres-url", default=None, metavar="URL", help="PostgreSQL store instead (postgresql://...)"
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=DEFAULT_BATCH_SIZE,
        metavar="N",
        help=f"events fetched, stored in one transaction and acknowledged together ({DEFAULT_BATCH_SIZE})",
    )


def run(args: argparse.Namespace) -> int:
    if args.batch_size < 1:
        raise ValueError("--batch-size must be >= 1")
    store = (
        open_postgres(args.postgres_url) if args.postgres_url else open_sqlite(args.db or default_ledger_db())
    )
    try:
        asyncio.run(_serve(args.nats_url, Ledger(store, args.batch_size)))
    finally:
        store.close()
    return 0


async def _serve(nats_url: str, ledger: Ledger) -> None:
    """Until SIGTERM (or Ctrl-C); then the consumer stops, the acks still buffered go out, and it closes."""
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    # Waits for NATS as long as it takes: under `fleet up` the ledger may start before it accepts.
    nc = await nats.connect(nats_url, name="edgeinfer-ledger", max_reconnect_attempts=-1, error_cb=_log_error)
    work = asyncio.create_task(ledger.run(nc), name="ledger")
    stopped = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait((work, stopped), return_when=asyncio.FIRST_COMPLETED)
        if work.done():
            work.result()  # what ended the ledger (it runs until cancelled)
    finally:
        for task in (work, stopped):
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await work
        with contextlib.suppress(Exception):
            await nc.flush(timeout=2)  # the acks of the last batch
        await nc.close()


async def _log_error(exc: Exception) -> None:
    """One line per NATS error (nats-py's default logs a traceback for every failed reconnect)."""
    logger.warning("NATS: %s", str(exc) or type(exc).__name__)

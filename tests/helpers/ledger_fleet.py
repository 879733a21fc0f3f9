"""`edgeinfer ledger` as a user starts it, for the ledger's tests and benchmark (their NATS server with
JetStream is helpers/jetstream.py)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import nats

from edgeinfer.ledger.client import LedgerUnavailable, query_usage


@dataclass
class LedgerProc:
    """`edgeinfer ledger --nats-url URL *store_args` in its own process."""

    workdir: Path
    nats_url: str
    store_args: list[str]
    proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 30.0) -> LedgerProc:
        cmd = [sys.executable, "-m", "edgeinfer.cli", "ledger", "--nats-url", self.nats_url, *self.store_args]
        with open(self.workdir / "ledger.log", "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        asyncio.run(self._until_answering(timeout))
        return self

    async def _until_answering(self, timeout: float) -> None:
        nc = await nats.connect(self.nats_url)
        try:
            deadline = time.monotonic() + timeout
            while True:
                assert self.proc is not None and self.proc.poll() is None, self.log()
                try:
                    await query_usage(nc, "nobody", None, None, timeout=0.5)
                    return
                except LedgerUnavailable:
                    if time.monotonic() > deadline:
                        raise AssertionError(f"the ledger never answered: {self.log()}") from None
                    await asyncio.sleep(0.05)
        finally:
            await nc.close()

    def log(self) -> str:
        return (self.workdir / "ledger.log").read_text()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(20)

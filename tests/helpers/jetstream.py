"""A nats-server with JetStream on loopback for tests: stoppable and restartable on the same port and
store, as an operator's restart would be."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from edgeinfer.fleet.nats_server import nats_args
from helpers.router_fleet import free_port


class JetStream:
    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.store = workdir / "js"
        self.log = workdir / "nats.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self, timeout: float = 10.0) -> JetStream:
        ready_before = self.log.read_text().count("Server is ready") if self.log.exists() else 0
        cmd = nats_args(self.port, self.store)
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while self.log.read_text().count("Server is ready") <= ready_before:
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError(f"nats-server did not start: {self.log.read_text()[-2000:]}")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)

    def kill(self) -> None:
        """SIGKILL, as a crash: JetStream recovers its store at the next start."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

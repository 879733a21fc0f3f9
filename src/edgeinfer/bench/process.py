"""Start a server subprocess, wait until it answers, and always stop it.

Used for the peer (llama.cpp's llama-server) and for our own server in the comparison scripts, so both are
managed the same way: the process gets its own process group, so killing it also kills anything it spawned.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx


class ServerStartError(RuntimeError):
    """The server process exited or never became healthy; the message carries its log tail."""


@dataclass
class ServerProcess:
    """A running server: its process, the URL it serves on, and where its output goes."""

    process: subprocess.Popen[bytes]
    base_url: str
    log_path: Path

    def log_tail(self, max_chars: int = 2000) -> str:
        """The last characters of the server's combined stdout/stderr (for error messages)."""
        try:
            return self.log_path.read_text(errors="replace")[-max_chars:]
        except OSError:
            return ""

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM the process group, then SIGKILL it if it has not exited within `grace_s`."""
        if self.process.poll() is not None:
            return
        _signal_group(self.process, signal.SIGTERM)
        try:
            self.process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            _signal_group(self.process, signal.SIGKILL)
            self.process.wait(timeout=grace_s)


def _signal_group(process: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, sig)


def start_server(
    argv: Sequence[str],
    base_url: str,
    log_path: Path,
    health_path: str = "/health",
    timeout_s: float = 300.0,
    env: dict[str, str] | None = None,
    poll_s: float = 0.25,
) -> ServerProcess:
    """Launch `argv` in a new process group and block until GET `base_url + health_path` returns 200,
    asking every `poll_s` (start-time benchmarks poll often, so the wait adds little to what they time).

    Raises ServerStartError (after killing the process) if it exits early or is not healthy within
    `timeout_s`.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            list(argv), stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env
        )
    server = ServerProcess(process=process, base_url=base_url.rstrip("/"), log_path=log_path)
    try:
        _wait_healthy(server, health_path, timeout_s, poll_s)
    except BaseException:
        server.stop()
        raise
    return server


def _wait_healthy(server: ServerProcess, health_path: str, timeout_s: float, poll_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    url = server.base_url + health_path
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise ServerStartError(
                f"server exited with code {server.process.returncode} before becoming healthy; "
                f"log tail:\n{server.log_tail()}"
            )
        with contextlib.suppress(httpx.HTTPError):
            # A loading server may answer 503 until the model is ready; only 200 counts.
            if httpx.get(url, timeout=2.0).status_code == 200:
                return
        time.sleep(poll_s)
    tail = server.log_tail()
    raise ServerStartError(f"server not healthy at {url} after {timeout_s:.0f} s; log tail:\n{tail}")


@contextlib.contextmanager
def running_server(
    argv: Sequence[str],
    base_url: str,
    log_path: Path,
    health_path: str = "/health",
    timeout_s: float = 300.0,
    env: dict[str, str] | None = None,
) -> Iterator[ServerProcess]:
    """Context manager around start_server that stops the server on any exit, including errors and Ctrl-C."""
    server = start_server(argv, base_url, log_path, health_path, timeout_s, env)
    try:
        yield server
    finally:
        server.stop()

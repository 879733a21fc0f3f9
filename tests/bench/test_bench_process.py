"""Server process management with real subprocesses: health wait, always-kill, early-exit diagnostics."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest

from edgeinfer.bench.process import ServerStartError, running_server, start_server


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _http_server_argv(port: int, directory: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "http.server",
        str(port),
        "--bind",
        "127.0.0.1",
        "--directory",
        str(directory),
    ]


def test_running_server_is_healthy_inside_and_dead_after(tmp_path: Path) -> None:
    port = _free_port()
    argv = _http_server_argv(port, tmp_path)
    with running_server(argv, f"http://127.0.0.1:{port}", tmp_path / "log.txt", health_path="/") as server:
        assert server.process.poll() is None
    assert server.process.poll() is not None


def test_server_is_killed_when_the_body_raises(tmp_path: Path) -> None:
    port = _free_port()
    argv = _http_server_argv(port, tmp_path)
    with (
        pytest.raises(RuntimeError, match="body failed"),
        running_server(argv, f"http://127.0.0.1:{port}", tmp_path / "log.txt", health_path="/") as server,
    ):
        raise RuntimeError("body failed")
    assert server.process.poll() is not None


def test_early_exit_reports_the_log_tail(tmp_path: Path) -> None:
    argv = [sys.executable, "-c", "import sys; print('unknown flag --frobnicate'); sys.exit(3)"]
    with pytest.raises(ServerStartError, match=r"(?s)code 3.*unknown flag --frobnicate"):
        start_server(argv, f"http://127.0.0.1:{_free_port()}", tmp_path / "log.txt", timeout_s=30)


def test_never_healthy_times_out_and_is_killed(tmp_path: Path) -> None:
    argv = [sys.executable, "-c", "import time; time.sleep(60)"]
    with pytest.raises(ServerStartError, match="not healthy"):
        start_server(argv, f"http://127.0.0.1:{_free_port()}", tmp_path / "log.txt", timeout_s=1)

"""`edgeinfer standby` and the commands it runs: the same output, exit status, signals and process state as
a command started on its own, and a clear fallback when the standby cannot run it."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from helpers.new_user import EDGEINFER, free_port

from edgeinfer.cli.standby import wire

GENERATE = ["generate", "--prompt", "Hello, world", "--max-tokens", "6", "--dtype", "float32"]


@dataclass
class Standby:
    process: subprocess.Popen[str]
    socket: Path
    env: dict[str, str]
    log: Path

    def children(self) -> list[int]:
        pid = self.process.pid
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


@contextlib.contextmanager
def started(root: Path, shell_redirects: str = "") -> Iterator[Standby]:
    """`edgeinfer standby` on a socket under `root`, through a shell that may close its descriptors; its
    stderr goes to `root/standby.log`."""
    env = {**os.environ, wire.STANDBY_ENV: str(root / "standby.sock")}
    log = root / "standby.log"
    command = f"exec {' '.join(EDGEINFER)} standby {shell_redirects} 2>{log}"
    proc = subprocess.Popen(["sh", "-c", command], env=env, text=True)
    try:
        deadline = time.monotonic() + 120
        while not log.exists() or "ready on" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        yield Standby(proc, root / "standby.sock", env, log)
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(30)
    assert code == 0, log.read_text()
    assert not (root / "standby.sock").exists(), "the standby leaves its socket behind"


@pytest.fixture(scope="module")
def standby(tmp_path_factory) -> Iterator[Standby]:
    with started(tmp_path_factory.mktemp("standby")) as running:
        yield running


def edgeinfer(args: list[str], env: dict[str, str], *python_flags: str, cwd: Path | None = None):
    command = [sys.executable, *python_flags, "-m", "edgeinfer.cli", *args]
    return subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True, timeout=300)


def imports_torch(importtime_log: str) -> bool:
    """Whether `python -X importtime` logged importing torch."""
    return re.search(r"^import time:.*\|\s+torch$", importtime_log, re.MULTILINE) is not None


def test_a_command_runs_in_the_standby_with_its_own_output(standby, tiny_llama, tmp_path):
    args = [*GENERATE, "--model", tiny_llama]
    alone = edgeinfer(args, {**standby.env, wire.STANDBY_ENV: "off"}, "-X", "importtime")
    handed = edgeinfer(args, standby.env, "-X", "importtime", cwd=tmp_path)
    assert alone.returncode == 0 and imports_torch(alone.stderr), alone.stderr[-3000:]
    assert handed.returncode == 0 and "not used" not in handed.stderr, handed.stderr[-3000:]
    assert handed.stdout == alone.stdout and handed.stdout.strip()
    # the client process imported no torch: the forked child of the standby ran the command
    assert not imports_torch(handed.stderr)


def test_usage_errors_keep_their_one_line_and_exit_status(standby, tiny_llama, tmp_path):
    cases = [
        (["serve", "--model", f"m={tmp_path / 'missing'}"], "edgeinfer serve: error:"),
        ([*GENERATE, "--model", tiny_llama, "--max-tokens", "0"], "edgeinfer generate: error:"),
        (["serve", "--no-such-flag"], "edgeinfer: error: unrecognized arguments"),
    ]
    for args, says in cases:
        res = edgeinfer(args, standby.env)
        errors = [line for line in res.stderr.splitlines() if "error" in line]
        assert res.returncode == 2 and res.stdout == "", (args, res.stderr)
        assert len(errors) == 1 and errors[0].startswith(says), (args, res.stderr)
        assert "not used" not in res.stderr and "Traceback" not in res.stderr, res.stderr


def ran_here(res: subprocess.CompletedProcess[str], missing: Path) -> bool:
    """`generate --model MISSING` ended in this process: its own one-line error, exit 2."""
    return res.returncode == 2 and f"edgeinfer generate: error: {missing}: no such file" in res.stderr


def test_a_client_whose_environment_differs_starts_on_its_own(standby, tmp_path):
    env = {**standby.env, "EDGEINFER_TEST_MARK": "1"}
    res = edgeinfer([*GENERATE, "--model", str(tmp_path / "missing")], env)
    said = [line for line in res.stderr.splitlines() if line.startswith("edgeinfer: standby")]
    assert said == [f"edgeinfer: standby at {standby.socket} not used: the environment differs "
                    "(EDGEINFER_TEST_MARK); starting here"], (said, standby.log.read_text())  # fmt: skip
    assert ran_here(res, tmp_path / "missing"), res.stderr


@contextlib.contextmanager
def served(standby: Standby, model: str, cwd: Path) -> Iterator[tuple[subprocess.Popen[bytes], str, int]]:
    """`edgeinfer serve` through the standby, pinned to one core; yields the client, the URL and the
    server's pid (the standby's one child) once /ready answers."""
    port = free_port()
    args = ["serve", "--model", f"tiny={model}", "--preload", "tiny", "--dtype", "float32"]
    args += ["--port", str(port)]
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(before)})  # the client's affinity is taken when it starts, by its fork
    try:
        client = subprocess.Popen([*EDGEINFER, *args], env=standby.env, cwd=cwd, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT)  # fmt: skip
    finally:
        os.sched_setaffinity(0, before)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while not _ready(url):
            assert client.poll() is None and time.monotonic() < deadline, client.stdout.read().decode()
            time.sleep(0.1)
        (server,) = standby.children()
        yield client, url, server
    finally:
        if client.poll() is None:
            client.kill()
        client.wait(30)


def _ready(url: str) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(url + "/ready", timeout=1.0).status_code == 200
    return False


def _gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while Path(f"/proc/{pid}").exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_serve_through_the_standby_is_its_clients_server(standby, tiny_llama, tmp_path):
    with served(standby, tiny_llama, tmp_path) as (client, url, server):
        assert server != client.pid
        assert os.readlink(f"/proc/{server}/cwd") == str(tmp_path)
        assert os.sched_getaffinity(server) == {min(os.sched_getaffinity(0))}
        body = {"model": "tiny", "prompt": "Hello, world", "max_tokens": 6, "temperature": 0}
        answer = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
        alone = edgeinfer([*GENERATE, "--model", tiny_llama], {**standby.env, wire.STANDBY_ENV: "off"})
        assert answer["choices"][0]["text"] + "\n" == alone.stdout
        client.send_signal(signal.SIGTERM)  # as a service manager stops it: forwarded to the server
        code = client.wait(60)
        log = client.stdout.read().decode()
    # uvicorn ends a SIGTERM by raising it again: the client dies of it as the server did
    assert code in (0, -signal.SIGTERM) and "Application shutdown complete" in log, log[-3000:]
    assert _gone(server, 10)


def test_a_killed_client_takes_its_server_with_it(standby, tiny_llama, tmp_path):
    with served(standby, tiny_llama, tmp_path) as (client, url, server):
        client.kill()
        client.wait(10)
        assert _gone(server, 30), "the server outlived its client"
        assert not _ready(url)


def test_a_second_standby_and_a_stale_socket(standby, tmp_path):
    second = edgeinfer(["standby"], standby.env)
    assert second.returncode == 2 and f"a standby already listens on {standby.socket}" in second.stderr
    stale = tmp_path / "stale.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(stale))  # a file left by a standby that died without removing it
    missing = tmp_path / "missing"
    res = edgeinfer([*GENERATE, "--model", str(missing)], {**standby.env, wire.STANDBY_ENV: str(stale)})
    assert f"standby at {stale} not used (Connection refused); starting here" in res.stderr
    assert ran_here(res, missing), res.stderr


def test_a_standby_without_stdin_and_stdout_gives_its_children_the_clients(tiny_llama, tmp_path):
    """Closed, the standby's own 0 and 1 are the numbers the client's descriptors arrive as."""
    with started(tmp_path, "0<&- 1>&-") as bare:
        args = [*GENERATE, "--model", tiny_llama]
        handed = edgeinfer(args, bare.env)
        alone = edgeinfer(args, {**bare.env, wire.STANDBY_ENV: "off"})
    assert handed.returncode == 0 and "not used" not in handed.stderr, handed.stderr[-3000:]
    assert handed.stdout == alone.stdout and handed.stdout.strip()


def test_an_edited_source_changes_the_code_stamp(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    source = package / "a.py"
    source.write_text("x = 1\n")
    before = wire.code_stamp(package)
    assert wire.code_stamp(package) == before
    source.write_text("x = 22\n")
    assert wire.code_stamp(package) != before

"""`edgeinfer fleet up` as a user runs it: everything starts, routes, and stops on Ctrl-C."""

from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from edgeinfer.fleet import up
from edgeinfer.fleet.up import budgets, plan


def test_plan_and_budgets():
    layout = plan(3)
    assert [code for code, _, _ in layout.locations] == ["FRA", "AMS", "LHR"]
    assert len(set(layout.node_ports + layout.router_ports + (layout.nats_port,))) == 7
    assert 'id = "ams-1"' in layout.fleet_toml()
    assert budgets("1GiB,2GiB,3GiB", 3) == ["1GiB", "2GiB", "3GiB"] and budgets("1GiB", 2) == ["1GiB"] * 2
    with pytest.raises(ValueError, match="comma-separated"):
        budgets("1GiB,2GiB", 3)
    with pytest.raises(ValueError, match="--locations"):
        plan(0)


class _FleetUp:
    """`edgeinfer fleet up --locations 2` as a child process; its output (stdout and stderr) is read line by
    line on a thread, so that a test can wait for a line without blocking on the pipe."""

    def __init__(self, tiny_dirs: dict[str, str], workdir: Path) -> None:
        cmd = [sys.executable, "-m", "edgeinfer.cli", "fleet", "up", "--locations", "2"]
        cmd += ["--workdir", str(workdir), "--model", f"tiny={tiny_dirs['tiny']}"]
        cmd += ["--memory-budget", "64MiB,32MiB"]
        cmd += ["--node-arg=--dtype=float32", "--node-arg=--kv-cache-memory=256KiB"]
        # As from a terminal: a test run started in the background by a non-interactive shell has SIGINT
        # ignored, which its children would inherit (Python leaves an inherited SIG_IGN alone).
        previous = signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            self.proc = subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ}, text=True
            )
        finally:
            signal.signal(signal.SIGINT, previous)
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.routers: dict[str, str] = {}
        self.nodes: dict[str, str] = {}
        self.workdir = workdir

    def read_urls(self) -> None:
        """Wait for the fleet to print its routers' and nodes' URLs."""
        while len(self.routers) < 2:
            match = re.match(r"(\w{3})\s+router (\S+)\s+node (\S+)", self.wait_for(r"\w{3}\s+router ", 300))
            assert match
            self.routers[match[1]], self.nodes[match[1]] = match[2], match[3]

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def wait_for(self, pattern: str, timeout: float) -> str:
        """The next line that matches `pattern` (earlier lines are dropped)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no line matching {pattern!r} in {timeout:.0f} s") from None
            assert line is not None, f"fleet up exited (code {self.proc.wait(10)}) before {pattern!r}"
            if re.match(pattern, line):
                return line

    def close(self) -> None:
        """Stop the fleet as Ctrl-C does, so that a failed test leaves no nodes behind: SIGKILL would orphan
        them. What is left after that is killed, children first."""
        if self.proc.poll() is not None:
            return
        children = _children(self.proc.pid)
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            for pid in children:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            self.proc.kill()
            self.proc.wait(30)


@pytest.fixture
def fleet_up(tiny_dirs: dict[str, str], tmp_path: Path) -> Iterator[_FleetUp]:
    fleet = _FleetUp(tiny_dirs, tmp_path)
    try:
        fleet.read_urls()
        yield fleet
    finally:
        fleet.close()


def _complete(url: str) -> httpx.Response:
    return httpx.post(
        url + "/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 2}, timeout=60
    )


def _stop_and_check_children_gone(fleet: _FleetUp) -> None:
    children = _children(fleet.proc.pid)
    fleet.proc.send_signal(signal.SIGINT)
    assert fleet.proc.wait(60) == 0
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in children)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fleet_up_routes_and_stops_on_ctrl_c(fleet_up: _FleetUp):
    response = _complete(fleet_up.routers["AMS"])
    assert response.status_code == 200 and response.headers["x-edgeinfer-location"] == "AMS"
    assert len(_children(fleet_up.proc.pid)) == 6  # NATS, the ledger, 2 nodes, 2 routers
    _until_the_ledger_bills(fleet_up.workdir / "ledger.sqlite", requests=1)
    _stop_and_check_children_gone(fleet_up)


def _until_the_ledger_bills(db: Path, requests: int, timeout: float = 30.0) -> None:
    """The fleet's ledger has stored the usage events of `requests` requests (nodes publish them on NATS)."""
    deadline = time.monotonic() + timeout
    while True:
        with (
            contextlib.suppress(sqlite3.OperationalError),  # not created yet
            contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as conn,
        ):
            if conn.execute("SELECT COUNT(*) FROM usage_events").fetchone()[0] >= requests:
                return
        assert time.monotonic() < deadline, f"the ledger has not stored {requests} requests"
        time.sleep(0.2)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_node_killed_under_fleet_up_is_restarted_on_its_port_and_routed_to_again(fleet_up: _FleetUp):
    """The operator's first fault drill: SIGKILL a node; the fleet stays up and the node comes back."""
    router, node = fleet_up.routers["AMS"], fleet_up.nodes["AMS"]
    assert _complete(router).headers["x-edgeinfer-location"] == "AMS"
    victim = _node_pid(fleet_up.proc.pid, "AMS")
    others = set(_children(fleet_up.proc.pid)) - {victim}
    os.kill(victim, signal.SIGKILL)
    fleet_up.wait_for(r"node-AMS exited with code -9 \(SIGKILL\); restarting it in ", 30)
    deadline = time.monotonic() + 120
    while not _answers(node):
        assert time.monotonic() < deadline, "the node did not come back on its port"
        time.sleep(0.2)
    assert _node_pid(fleet_up.proc.pid, "AMS") != victim
    response = _complete(node)  # the restarted node itself answers
    assert response.status_code == 200 and response.json()["choices"][0]["text"] is not None
    deadline = time.monotonic() + 60
    while (response := _complete(router)).headers.get("x-edgeinfer-location") != "AMS":
        assert response.status_code == 200, response.text  # meanwhile FRA serves
        assert time.monotonic() < deadline, "the router does not route to the restarted node"
        time.sleep(0.5)
    assert fleet_up.proc.poll() is None and others <= set(_children(fleet_up.proc.pid))
    _stop_and_check_children_gone(fleet_up)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url + "/ready", timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


def _node_pid(fleet_pid: int, location: str) -> int:
    (pid,) = [pid for pid in _children(fleet_pid) if _is_node(_argv(pid), location)]
    return pid


def _argv(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    except FileNotFoundError:
        return []


def _is_node(argv: list[str], location: str) -> bool:
    return "edgeinfer.node" in argv and argv[argv.index("--location") + 1] == location


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is gone for our purposes (its parent, the fleet, has exited).
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_stop_kills_a_process_that_ignores_sigterm_after_one_shared_deadline(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(up, "STOP_TIMEOUT_S", 1.0)
    fleet = up.Supervisor(tmp_path)
    stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True)"
    stubborn += "; time.sleep(60)"
    for name in ("a", "b"):
        fleet.spawn(name, [sys.executable, "-c", stubborn])
    while any("up" not in (tmp_path / f"{n}.log").read_text() for n in ("a", "b")):
        time.sleep(0.05)  # both have set their handlers
    started = time.monotonic()
    fleet.stop()
    assert time.monotonic() - started < 5  # one deadline for both, not one each
    assert all(proc.returncode == -signal.SIGKILL for _, proc in fleet.procs)
    assert "did not stop 1 s after SIGTERM; killed" in capsys.readouterr().err


def test_an_exited_process_is_restarted_with_a_doubling_backoff_then_left_down(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(up, "MAX_RESTARTS", 2)
    fleet = up.Supervisor(tmp_path)
    fleet.spawn("crashy", [sys.executable, "-c", "print('started'); raise SystemExit(3)"])
    fleet.spawn("steady", [sys.executable, "-c", "import time; time.sleep(60)"])
    steady = fleet.procs[1][1]
    now = 0.0
    for delay in (1, 2):
        fleet.procs[0][1].wait(30)
        fleet.check(now)
        assert capsys.readouterr().err == f"crashy exited with code 3; restarting it in {delay} s\n"
        exited = fleet.procs[0][1]
        fleet.check(now + delay - 0.1)
        assert fleet.procs[0][1] is exited  # not before its backoff
        now += delay
        fleet.check(now)
        assert fleet.procs[0][1] is not exited
    fleet.procs[0][1].wait(30)
    fleet.check(now)
    given_up = "crashy exited with code 3 after 2 restarts within 600 s; leaving it down"
    assert given_up in capsys.readouterr().err
    fleet.check(now + 3600)
    assert capsys.readouterr().err == "" and fleet.procs[1][1] is steady and steady.poll() is None
    assert (tmp_path / "crashy.log").read_text() == "started\n" * 3  # a restart appends to the log
    fleet.stop()


def test_restarts_outside_the_window_do_not_count(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(up, "MAX_RESTARTS", 1)
    fleet = up.Supervisor(tmp_path)
    fleet.spawn("flaky", [sys.executable, "-c", "raise SystemExit(1)"])
    for hour in range(3):
        fleet.procs[0][1].wait(30)
        fleet.check(hour * 3600.0)
        fleet.check(hour * 3600.0 + 1)
    assert capsys.readouterr().err.count("flaky exited with code 1; restarting it in 1 s") == 3
    fleet.stop()

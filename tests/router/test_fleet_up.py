"""`edgeinfer fleet up` as a user runs it: everything starts, routes, and stops on Ctrl-C."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

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


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fleet_up_routes_and_stops_on_ctrl_c(tiny_dirs: dict[str, str], tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "edgeinfer.cli",
        "fleet",
        "up",
        "--locations",
        "2",
        "--workdir",
        str(tmp_path),
    ]
    cmd += ["--model", f"tiny={tiny_dirs['tiny']}", "--memory-budget", "64MiB,32MiB"]
    cmd += ["--node-arg=--dtype=float32", "--node-arg=--kv-cache-memory=256KiB"]
    # As from a terminal: a test run started in the background by a non-interactive shell has SIGINT
    # ignored, which its children would inherit (Python leaves an inherited SIG_IGN alone).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ}, text=True
        )
    finally:
        signal.signal(signal.SIGINT, previous)
    try:
        routers = {}
        while len(routers) < 2:
            line = proc.stdout.readline()
            assert line, f"fleet up exited early (code {proc.poll()})"
            if match := re.match(r"(\w{3})\s+router (\S+)", line):
                routers[match[1]] = match[2]
        response = httpx.post(
            routers["AMS"] + "/v1/completions",
            json={"model": "tiny", "prompt": "Hi", "max_tokens": 2},
            timeout=60,
        )
        assert response.status_code == 200 and response.headers["x-edgeinfer-location"] == "AMS"
        children = _children(proc.pid)
        assert len(children) == 5  # NATS, 2 nodes, 2 routers
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(pid) for pid in children)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


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
    fleet = up.Fleet(tmp_path)
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

"""`edgeinfer fleet up`: a whole fleet on loopback — NATS (with JetStream), the usage ledger, one node and
one router per location.

Every process is a child of this one. One that exits once the fleet is up is restarted on its port, with a
backoff, and left down if it keeps exiting (`Supervisor.check`); Ctrl-C (or SIGTERM) stops routers, then
nodes, then the ledger, then NATS.
"""

from __future__ import annotations

import secrets
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from edgeinfer.fleet.nats_server import nats_args, start_nats

# Edge sites to draw from, in this order (coordinates of the airports).
SITES: tuple[tuple[str, float, float], ...] = (
    ("FRA", 50.03, 8.57),
    ("AMS", 52.31, 4.76),
    ("LHR", 51.47, -0.45),
    ("CDG", 49.01, 2.55),
    ("WAW", 52.17, 20.97),
    ("MAD", 40.47, -3.56),
    ("IAD", 38.95, -77.46),
    ("SIN", 1.36, 103.99),
)


@dataclass(frozen=True)
class FleetPlan:
    locations: tuple[tuple[str, float, float], ...]
    node_ports: tuple[int, ...]
    router_ports: tuple[int, ...]
    nats_port: int

    def fleet_toml(self) -> str:
        lines = []
        for (code, lat, lon), port in zip(self.locations, self.node_ports, strict=True):
            lines += ["[[locations]]", f'code = "{code}"', f"lat = {lat}", f"lon = {lon}"]
            lines += [
                "[[locations.nodes]]",
                f'id = "{code.lower()}-1"',
                f'url = "http://127.0.0.1:{port}"',
                "",
            ]
        return "\n".join(lines)


def plan(count: int) -> FleetPlan:
    if not 1 <= count <= len(SITES):
        raise ValueError(f"--locations must be in [1, {len(SITES)}]")
    ports = _free_ports(2 * count + 1)
    return FleetPlan(SITES[:count], tuple(ports[:count]), tuple(ports[count : 2 * count]), ports[-1])


def budgets(value: str | None, count: int) -> list[str | None]:
    """`--memory-budget 2GiB` for every node, or one per location: `2GiB,1GiB,...`."""
    if value is None:
        return [None] * count
    parts = value.split(",")
    if len(parts) == 1:
        return parts * count
    if len(parts) != count:
        raise ValueError(f"--memory-budget: give one size or {count} comma-separated sizes")
    return parts


# Seconds the fleet's processes have, together, to exit after SIGTERM (a node finishes its streams).
STOP_TIMEOUT_S = 30.0
# A process that exits once the fleet is up is started again with the same arguments (and so the same port)
# after a backoff that doubles with each restart in the window, from RESTART_BACKOFF_S up to
# RESTART_BACKOFF_MAX_S. One that needs more than MAX_RESTARTS restarts in RESTART_WINDOW_S is crash-looping:
# it is left down and reported, and the rest of the fleet serves on without it, as a fleet does around a
# failed machine (stopping everything would turn one bad process into an outage).
RESTART_BACKOFF_S = 1.0
RESTART_BACKOFF_MAX_S = 30.0
MAX_RESTARTS = 5
RESTART_WINDOW_S = 600.0
NATS = "nats"
LEDGER = "ledger"


@dataclass
class _Member:
    """What restarting a process needs: its arguments, and when it was last restarted."""

    args: list[str]
    restarts: deque[float] = field(default_factory=deque)
    due: float | None = None  # when a pending restart starts it again
    down: bool = False  # given up on


class Supervisor:
    """The fleet's processes: started, watched, restarted when they exit, stopped in order."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []
        self._members: dict[str, _Member] = {}

    def spawn(self, name: str, args: list[str]) -> None:
        self.adopt(name, self._start(name, args, "wb"), args)

    def adopt(self, name: str, proc: subprocess.Popen[bytes], args: list[str]) -> None:
        """Supervise a process started elsewhere (NATS, started by `start_nats`), restarted with `args`."""
        self.procs.append((name, proc))
        self._members[name] = _Member(args)

    def _start(self, name: str, args: list[str], mode: str) -> subprocess.Popen[bytes]:
        # A restart appends, so the log keeps what the process said before it exited.
        with open(self.workdir / f"{name}.log", mode) as log:
            return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)

    def wait_ready(self, urls: list[str], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        pending = list(urls)
        while pending:
            for name, proc in self.procs:
                if proc.poll() is not None:
                    log = (self.workdir / f"{name}.log").read_text()[-2000:]
                    raise RuntimeError(f"{name} exited with {proc.returncode}:\n{log}")
            pending = [u for u in pending if not _ready(u)]
            if pending and time.monotonic() > deadline:
                raise RuntimeError(f"not ready after {timeout:.0f} s: {', '.join(pending)}")
            time.sleep(0.2)

    def supervise(self) -> None:
        """Restart what exits, until Ctrl-C or SIGTERM (KeyboardInterrupt)."""
        while True:
            self.check(time.monotonic())
            time.sleep(0.2)

    def check(self, now: float) -> None:
        """Report each process that has exited and schedule its restart; start those that are due."""
        for index, (name, proc) in enumerate(self.procs):
            member = self._members[name]
            if member.down:
                continue
            if member.due is not None:
                if now >= member.due:
                    self._restart(index, name, member, now)
                continue
            code = proc.poll()
            if code is not None:
                self._exited(name, code, member, now)

    def _exited(self, name: str, code: int, member: _Member, now: float) -> None:
        while member.restarts and member.restarts[0] <= now - RESTART_WINDOW_S:
            member.restarts.popleft()
        if len(member.restarts) >= MAX_RESTARTS:
            member.down = True
            print(
                f"{name} exited with code {_describe(code)} after {MAX_RESTARTS} restarts within "
                f"{RESTART_WINDOW_S:.0f} s; leaving it down (log: {self.workdir / f'{name}.log'})",
                file=sys.stderr,
            )
            return
        delay = min(RESTART_BACKOFF_MAX_S, RESTART_BACKOFF_S * 2 ** len(member.restarts))
        member.due = now + delay
        print(f"{name} exited with code {_describe(code)}; restarting it in {delay:g} s", file=sys.stderr)

    def _restart(self, index: int, name: str, member: _Member, now: float) -> None:
        member.due = None
        member.restarts.append(now)
        self.procs[index] = (name, self._start(name, member.args, "ab"))

    def stop(self) -> None:
        """Routers first (they were started last), so no request is sent to a node that is going; the ledger
        after the nodes, so that it stores the usage they publish while they stop; NATS last, so that nothing
        loses its connection to it while stopping. One deadline for all of them, not one each: a process that
        has not exited by then is killed, and named, so that Ctrl-C never waits on a stuck process once per
        process."""
        deadline = time.monotonic() + STOP_TIMEOUT_S
        members = list(reversed(self.procs))
        self._stop([m for m in members if m[0] not in (NATS, LEDGER)], deadline)
        for last in (LEDGER, NATS):
            self._stop([m for m in members if m[0] == last], deadline)

    @staticmethod
    def _stop(procs: list[tuple[str, subprocess.Popen[bytes]]], deadline: float) -> None:
        for _, proc in procs:
            if proc.poll() is None:
                proc.terminate()
        for name, proc in procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                print(f"{name} did not stop {STOP_TIMEOUT_S:.0f} s after SIGTERM; killed", file=sys.stderr)
                proc.kill()
                proc.wait(10)


def _describe(code: int) -> str:
    """An exit code, with the signal's name where a signal ended the process (Popen gives -N)."""
    if code >= 0:
        return str(code)
    try:
        return f"{code} ({signal.Signals(-code).name})"
    except ValueError:
        return str(code)


def run_fleet(
    count: int, node_args: list[str], memory_budget: str | None, emulate_rtt: bool, workdir: Path
) -> int:
    layout = plan(count)
    (workdir / "fleet.toml").write_text(layout.fleet_toml())
    (workdir / "router-secret").write_text(secrets.token_hex(32))
    fleet = Supervisor(workdir)
    store = workdir / "jetstream"
    nats = start_nats(layout.nats_port, workdir / "nats.log", store)
    fleet.adopt(NATS, nats, nats_args(layout.nats_port, store))
    nats_url = f"nats://127.0.0.1:{layout.nats_port}"
    py = [sys.executable, "-m"]
    # Before the nodes, so that their first usage events find it (they would wait in the stream anyway).
    ledger = [*py, "edgeinfer.cli", "ledger", "--nats-url", nats_url, "--db", str(workdir / "ledger.sqlite")]
    fleet.spawn(LEDGER, ledger)
    common = ["--nats-url", nats_url, "--router-secret-file", str(workdir / "router-secret")]
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        for (code, _, _), port, budget in zip(
            layout.locations, layout.node_ports, budgets(memory_budget, count), strict=True
        ):
            args = [
                *py,
                "edgeinfer.node",
                "--port",
                str(port),
                "--node-id",
                f"{code.lower()}-1",
                "--location",
                code,
            ]
            args += [*common, "--usage-db", str(workdir / f"usage-{code}.sqlite"), "--preload", *node_args]
            fleet.spawn(f"node-{code}", args + (["--memory-budget", budget] if budget else []))
        fleet.wait_ready([f"http://127.0.0.1:{p}" for p in layout.node_ports], timeout=600)
        for (code, _, _), port in zip(layout.locations, layout.router_ports, strict=True):
            args = [
                *py,
                "edgeinfer.cli",
                "router",
                "--fleet",
                str(workdir / "fleet.toml"),
                "--location",
                code,
            ]
            args += ["--port", str(port), *common] + (["--emulate-rtt"] if emulate_rtt else [])
            fleet.spawn(f"router-{code}", args)
        fleet.wait_ready([f"http://127.0.0.1:{p}" for p in layout.router_ports], timeout=60)
        _print_urls(layout, nats_url, workdir)
        fleet.supervise()
    except KeyboardInterrupt:
        return 0
    finally:
        signal.signal(signal.SIGTERM, previous)
        fleet.stop()
        print("fleet stopped", file=sys.stderr)


def _interrupt(signum: int, frame: object) -> None:
    """SIGTERM stops the fleet the way Ctrl-C does."""
    raise KeyboardInterrupt


def _print_urls(layout: FleetPlan, nats_url: str, workdir: Path) -> None:
    print(f"NATS    {nats_url}")
    print(f"LEDGER  {workdir / 'ledger.sqlite'} (usage queries on NATS: edgeinfer.ledger.usage)")
    for (code, _, _), node, router in zip(
        layout.locations, layout.node_ports, layout.router_ports, strict=True
    ):
        print(f"{code}     router http://127.0.0.1:{router}   node http://127.0.0.1:{node}")
    print(f"fleet file and logs in {workdir}; Ctrl-C stops everything", flush=True)


def _ready(url: str) -> bool:
    try:
        return httpx.get(url + "/ready", timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in sockets]
    finally:
        for s in sockets:
            s.close()

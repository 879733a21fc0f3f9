"""A loopback fleet for router tests and benchmarks: node processes, routers in threads, tenants, node
arguments. Imported from here, not from a conftest, so that any test directory resolves them."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
import uvloop

from edgeinfer.api.keys import hash_key
from edgeinfer.router.app import Router
from edgeinfer.router.config import RouterConfig
from edgeinfer.router.fleet_file import Fleet
from edgeinfer.router.server import serve

SECRET = b"router-test-secret-0123456789"
KEYS = {"alice": "alice-key", "bob": "bob-key"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class NodeProc:
    node_id: str
    location: str
    port: int
    args: list[str]
    log: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        cmd = [sys.executable, "-m", "edgeinfer.node", "--port", str(self.port), *self.args]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ})

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(self.log.read_text())
            try:
                if httpx.get(self.url + "/ready", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"node {self.node_id} did not become ready: {self.log.read_text()}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()


class RouterProc(NodeProc):
    """`edgeinfer router *args` in its own process, as a user starts one (its `node_id`: a name for it)."""

    def start(self) -> None:
        cmd = [sys.executable, "-m", "edgeinfer.cli", "router", "--port", str(self.port), *self.args]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)


@dataclass
class LoopbackFleet:
    workdir: Path
    nats_url: str
    nodes: dict[str, NodeProc] = field(default_factory=dict)
    # In the fleet file from the start, started only by the breaker test: a node that is not there yet.
    late: dict[str, NodeProc] = field(default_factory=dict)

    def fleet(self, rtt_ms: dict[str, float] | None = None) -> Fleet:
        from edgeinfer.router.fleet_file import parse_fleet

        coords = {"FRA": (50.03, 8.57), "AMS": (52.31, 4.76), "SIN": (1.36, 103.99)}
        locations = []
        for code, (lat, lon) in coords.items():
            nodes = [*self.nodes.values(), *self.late.values()]
            members = [{"id": n.node_id, "url": n.url} for n in nodes if n.location == code]
            locations.append({"code": code, "lat": lat, "lon": lon, "nodes": members})
        return parse_fleet({"locations": locations, "rtt_ms": rtt_ms or {}})


T = TypeVar("T")


class RouterThread:
    """A router serving on a loopback port from its own uvloop event loop, in a thread of the test process
    (its state is inspectable)."""

    def __init__(self, config: RouterConfig, fleet: Fleet) -> None:
        self.router = Router(config, fleet)
        self.url = ""
        self._loop = uvloop.new_event_loop()
        self._stop = asyncio.Event()
        self._listening = threading.Event()
        self._thread = threading.Thread(target=self._run, name="test-router", daemon=True)

    def _run(self) -> None:
        def listening(port: int) -> None:
            self.url = f"http://127.0.0.1:{port}"
            self._listening.set()

        self._loop.run_until_complete(serve(self.router, "127.0.0.1", 0, self._stop, on_listening=listening))
        self._loop.close()

    def start(self, timeout: float = 30.0) -> RouterThread:
        self._thread.start()
        if not self._listening.wait(timeout):
            raise RuntimeError("the test router did not start")
        return self

    @property
    def service(self) -> Any:
        return self.router.service

    def wait_for_nodes(self, node_ids: set[str], timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            seen = {n.node_id for n in self.service.state.snapshot().nodes}
            if node_ids <= seen:
                return
            time.sleep(0.05)
        raise AssertionError(f"router never heard from {node_ids - seen}")

    def call(self, work: Callable[[], Coroutine[Any, Any, T]], timeout: float = 30.0) -> T:
        """Run `work` on the router's event loop; its result."""
        return asyncio.run_coroutine_threadsafe(work(), self._loop).result(timeout)

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(20)


def one_node_fleet(node_id: str, url: str, location: str = "FRA") -> Fleet:
    """A fleet file of one location holding one node (an in-process one: the router polls its status)."""
    from edgeinfer.router.fleet_file import parse_fleet

    nodes = [{"id": node_id, "url": url}]
    return parse_fleet({"locations": [{"code": location, "lat": 50.03, "lon": 8.57, "nodes": nodes}]})


def write_tenants(workdir: Path) -> Path:
    path = workdir / "tenants.json"
    path.write_text(
        json.dumps({"tenants": [{"name": n, "key_sha256": hash_key(k)} for n, k in KEYS.items()]})
    )
    return path


def node_args(workdir: Path, node_id: str, location: str, nats_url: str, models: dict[str, str]) -> list[str]:
    secret_file = workdir / "secret"
    secret_file.write_bytes(SECRET)
    args = ["--node-id", node_id, "--location", location, "--nats-url", nats_url]
    args += ["--tenants", str(workdir / "tenants.json"), "--router-secret-file", str(secret_file)]
    args += ["--usage-db", str(workdir / f"{node_id}.sqlite"), "--no-access-log"]
    args += ["--finetunes-dir", str(workdir / f"{node_id}-finetunes")]
    # The routers (threads of the test process, on loopback) are the nodes' proxies, as in a deployment: every
    # routed client arrives through them, so they are exempt from the per-address connection bound. Without
    # this, the routers' idle keep-alive connections from earlier tests could fill loopback's 64 and the
    # next direct request was refused with a 429.
    args += ["--trusted-proxy", "127.0.0.1"]
    # Two sequences per engine, so that a few long streams queue and saturate a node.
    args += ["--dtype", "float32", "--kv-cache-memory", "4MiB", "--batch-window-ms", "0"]
    args += ["--max-num-seqs", "2"]
    for name, path in models.items():
        args += ["--model", f"{name}={path}"]
    return args


@contextlib.contextmanager
def fra_fleet(workdir: Path, nats_url: str, nodes: list[NodeProc]) -> Iterator[RouterProc]:
    """The nodes (one location, FRA) and a router on NATS in front of them, started and ready; all stopped
    after. The tenants file and router secret are `write_tenants`' and `node_args`' in `workdir`."""
    fleet_file = workdir / "fleet.toml"
    fleet_file.write_text(
        '[[locations]]\ncode = "FRA"\nlat = 50.03\nlon = 8.57\n'
        + "".join(f'[[locations.nodes]]\nid = "{n.node_id}"\nurl = "{n.url}"\n' for n in nodes)
    )
    args = ["--fleet", str(fleet_file), "--location", "FRA", "--nats-url", nats_url]
    args += ["--tenants", str(workdir / "tenants.json"), "--router-secret-file", str(workdir / "secret")]
    router = RouterProc("router", "FRA", free_port(), args, workdir / "router.log")
    try:
        for node in nodes:
            node.start()
        for node in nodes:
            node.wait_ready()
        router.start()
        router.wait_ready()
        yield router
    finally:
        router.stop()
        for node in nodes:
            node.stop()

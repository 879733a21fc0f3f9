"""Node servers for tests: in-process on a thread (`NodeFactory`, `LiveServer`) and as separate processes
(`NodeProcesses`). Imported from here, not from a conftest, so that any test directory resolves them."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from edgeinfer.api.limits import NodeLimits
from edgeinfer.engine.config import EngineConfig
from edgeinfer.node.config import ConnectionLimits, NodeConfig
from edgeinfer.node.http.app import create_app
from edgeinfer.node.http.server import NodeServer, uvicorn_config
from edgeinfer.node.service import NodeService
from edgeinfer.pool.loader import EngineLoader
from edgeinfer.pool.manager import ModelPool
from edgeinfer.pool.spec import LOCAL, UPSTREAM, MemberSpec
from helpers.node_engine import TEST_ENGINE
from helpers.uvicorn_thread import UvicornThread


class LiveServer:
    """A uvicorn server on a free loopback port, running in a thread with its own event loop."""

    def __init__(self, app: Any, service: NodeService) -> None:
        self.service = service
        config = uvicorn_config(app, app.state.node_config, "127.0.0.1", 0, log_level="warning")
        self._thread = UvicornThread(config, "test-node", NodeServer)
        self.url = ""

    def start(self, timeout: float = 60.0) -> LiveServer:
        self.url = self._thread.start(timeout)
        return self

    def stop(self) -> None:
        self._thread.stop(30)

    def ask_to_stop(self) -> None:
        """Start the shutdown (as SIGTERM does) without waiting for it."""
        self._thread.ask_to_stop()

    def is_serving(self) -> bool:
        return self._thread.is_alive()

    def requests_in_flight(self) -> int:
        """Requests the server is running now (from their headers to the end of their answer)."""
        return len(self._thread.server.server_state.tasks)

    def shrink_send_buffers(self, size: int = 4096) -> int:
        """Give every open connection a small kernel send buffer, as a slow network would (loopback's
        autotuned buffers take megabytes before a writer notices that nobody reads). Returns how many."""
        connections = list(self._thread.server.server_state.connections)
        for protocol in connections:
            protocol.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size)
        return len(connections)

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def engine(self, model: str) -> Any:
        return self.service.pool.residents()[model].engine

    def wait_idle(self, model: str, timeout: float = 10.0) -> None:
        """Until the engine has nothing running or waiting (aborts are applied by its loop)."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.engine(model).stats()
            if stats.num_running == 0 and stats.num_waiting == 0:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"engine {model} still busy: {stats}")
            time.sleep(0.02)


@dataclasses.dataclass
class NodeFactory:
    tmp_path: Path
    servers: list[LiveServer] = dataclasses.field(default_factory=list)

    def __call__(
        self,
        models: dict[str, str],
        *,
        upstreams: dict[str, str] | None = None,
        upstream_tokenizers: dict[str, str] | None = None,
        aliases: dict[str, tuple[str, ...]] | None = None,
        tenants: list[dict[str, Any]] | None = None,
        budget: int | None = None,
        preload: tuple[str, ...] = (),
        engine: EngineConfig = TEST_ENGINE,
        connections: ConnectionLimits | None = None,
        trusted_proxies: tuple[str, ...] = (),
        usage_checkpoint_s: float = 1.0,
        router_secret: bytes | None = None,
        node_id: str = "",
        location: str = "",
        **limits: int,
    ) -> LiveServer:
        specs = [MemberSpec(n, LOCAL, p, (aliases or {}).get(n, ())) for n, p in models.items()]
        tokenizers = upstream_tokenizers or {}
        specs += [
            MemberSpec(n, UPSTREAM, u, tokenizer=tokenizers.get(n)) for n, u in (upstreams or {}).items()
        ]
        tenants_file = None
        if tenants is not None:
            tenants_file = self.tmp_path / f"tenants-{len(self.servers)}.json"
            tenants_file.write_text(json.dumps({"tenants": tenants}))
        config = NodeConfig(
            limits=NodeLimits(**limits),
            connections=connections or ConnectionLimits(),
            trusted_proxies=trusted_proxies,
            usage_checkpoint_s=usage_checkpoint_s,
            tenants_file=str(tenants_file) if tenants_file else None,
            usage_db=str(self.tmp_path / f"usage-{len(self.servers)}.sqlite"),
            finetunes_dir=str(self.tmp_path / f"finetunes-{len(self.servers)}"),
            preload=preload,
            router_secret=router_secret,
            node_id=node_id,
            location=location,
        )
        pool = ModelPool(specs, EngineLoader(engine), budget_bytes=budget)
        app = create_app(config, pool)
        server = LiveServer(app, app.state.service).start()
        self.servers.append(server)
        return server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class NodeProcesses:
    """`python -m edgeinfer.node ...` as separate processes, stopped together."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, *args: str, timeout: float = 90.0) -> str:
        """Start one; returns its base URL once /ready answers 200."""
        port = free_port()
        log_path = self.workdir / f"proc-{port}.log"
        cmd = [sys.executable, "-m", "edgeinfer.node", "--port", str(port), *args]
        cmd += ["--usage-db", str(self.workdir / f"proc-{port}.sqlite"), "--no-access-log"]
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ})
        self.procs.append(proc)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(log_path.read_text())
            try:
                if httpx.get(url + "/ready", timeout=1.0).status_code == 200:
                    return url
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"node process did not become ready: {log_path.read_text()}")

    def stop(self) -> None:
        for proc in self.procs:
            proc.terminate()
            proc.wait(30)

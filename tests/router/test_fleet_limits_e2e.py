"""Fleet limits end to end: three router processes on one JetStream, a real node behind them, a tenant
sending through all three routers at once gets its limit per window across the fleet, not three times it."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from helpers.jetstream import JetStream
from helpers.router_fleet import KEYS, NodeProc, free_port, node_args

from edgeinfer.api.keys import hash_key

WINDOW_S = 3.0
LIMIT = 8  # requests per window for alice


@dataclass
class RouterProc:
    port: int
    proc: subprocess.Popen[bytes]
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(self.log.read_text())
            try:
                if httpx.get(self.url + "/ready", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"router did not become ready: {self.log.read_text()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(20)


def _tenants(path: Path, limits: dict[str, dict[str, int]]) -> Path:
    entries = [{"name": n, "key_sha256": hash_key(k), **limits.get(n, {})} for n, k in KEYS.items()]
    path.write_text(json.dumps({"tenants": entries}))
    return path


def _fleet_file(path: Path, node: NodeProc) -> Path:
    path.write_text(
        f'[[locations]]\ncode = "FRA"\nlat = 50.03\nlon = 8.57\n'
        f'[[locations.nodes]]\nid = "{node.node_id}"\nurl = "{node.url}"\n'
    )
    return path


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, tiny_dirs: dict[str, str]) -> Iterator[list[RouterProc]]:
    workdir = tmp_path_factory.mktemp("fleet-limits")
    nats = JetStream(workdir).start()
    # the node's own limits are its backstop, per node and per minute; here they would hide the fleet's
    _tenants(workdir / "tenants.json", {})
    args = node_args(workdir, "fra-1", "FRA", nats.url, {"tiny": tiny_dirs["tiny"]})
    node = NodeProc("fra-1", "FRA", free_port(), [*args, "--preload", "tiny"], workdir / "fra-1.log")
    routers: list[RouterProc] = []
    try:
        node.start()
        node.wait_ready()
        limited = _tenants(workdir / "router-tenants.json", {"alice": {"requests_per_minute": LIMIT}})
        fleet_file = _fleet_file(workdir / "fleet.toml", node)
        for i in range(3):
            port, log = free_port(), workdir / f"router-{i}.log"
            cmd = [sys.executable, "-m", "edgeinfer.cli", "router", "--fleet", str(fleet_file)]
            cmd += [
                "--location",
                "FRA",
                "--port",
                str(port),
                "--nats-url",
                nats.url,
                "--tenants",
                str(limited),
            ]
            cmd += ["--router-secret-file", str(workdir / "secret"), "--limits-window-s", str(WINDOW_S)]
            with open(log, "wb") as out:
                proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
            routers.append(RouterProc(port, proc, log))
        for router in routers:
            router.wait_ready()
        yield routers
    finally:
        for router in routers:
            router.stop()
        node.stop()
        nats.stop()


def _hammer(url: str, key: str, until: float, out: list[httpx.Response]) -> None:
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 1}
    with httpx.Client(headers={"Authorization": f"Bearer {key}"}, timeout=30) as client:
        while time.time() < until:
            out.append(client.post(url + "/v1/completions", json=body))


def test_a_tenant_through_three_routers_gets_its_limit_per_window_across_the_fleet(
    fleet: list[RouterProc],
) -> None:
    # start just after a window begins and run through two whole windows more
    time.sleep(WINDOW_S - time.time() % WINDOW_S + 0.05)
    start = time.time()
    until = start + 2 * WINDOW_S + 0.5
    results: list[list[httpx.Response]] = [[] for _ in fleet]
    threads = [
        threading.Thread(target=_hammer, args=(r.url, KEYS["alice"], until, out))
        for r, out in zip(fleet, results, strict=True)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    responses = [r for out in results for r in out]
    admitted = sum(r.status_code == 200 for r in responses)
    touched = int(time.time() // WINDOW_S) - int(start // WINDOW_S) + 1
    # the load covered the first two windows (from just after their start): both used up; no window gave
    # more than the limit, fleet-wide
    assert LIMIT * 2 <= admitted <= LIMIT * touched, (admitted, touched)
    assert sum(r.status_code == 200 for r in results[0]) < admitted  # several routers admitted some
    refused = [r for r in responses if r.status_code != 200]
    assert refused and {r.status_code for r in refused} == {429}
    for r in refused:
        assert r.json()["error"]["type"] == "rate_limit_error"
        assert r.headers.get("x-request-id") and float(r.headers["retry-after"]) > 0
    # bob has no limit: the routers let him through whatever alice does
    with httpx.Client(headers={"Authorization": f"Bearer {KEYS['bob']}"}, timeout=30) as client:
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 1}
        assert all(
            client.post(fleet[0].url + "/v1/completions", json=body).status_code == 200 for _ in range(3)
        )


def test_the_routers_metrics_count_each_tenants_admissions_and_refusals(fleet: list[RouterProc]) -> None:
    text = "\n".join(httpx.get(r.url + "/metrics").text for r in fleet)
    assert 'edgeinfer_router:tenant_admitted_requests_total{tenant="alice",via="fleet"}' in text
    assert 'edgeinfer_router:tenant_rejected_requests_total{limit="requests",tenant="alice"}' in text
    assert "edgeinfer_router:tenants_file_mismatch 0.0" in text

"""Fleet limits end to end: three router processes on one JetStream, a real node behind them, a tenant
sending through all three routers at once gets its limit per window across the fleet, not three times it."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from helpers.jetstream import JetStream
from helpers.ledger_fleet import LedgerProc
from helpers.router_fleet import NodeProc, RouterProc, free_port, node_args

from edgeinfer.api.keys import hash_key

WINDOW_S = 3.0
LIMIT = 8  # requests per window for alice
TOKEN_LIMIT = 400  # tokens per window for carol
KEYS = {"alice": "alice-key", "bob": "bob-key", "carol": "carol-key", "dave": "dave-key"}
LIMITS = {
    "alice": {"requests_per_minute": LIMIT},
    "carol": {"tokens_per_minute": TOKEN_LIMIT},
    "dave": {"requests_per_minute": 30},
}


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


@dataclass
class Fleet:
    routers: list[RouterProc]
    node: NodeProc
    ledger: LedgerProc


def _router(workdir: Path, i: int, nats_url: str, fleet_file: Path, tenants: Path) -> RouterProc:
    args = ["--fleet", str(fleet_file), "--location", "FRA", "--nats-url", nats_url]
    args += ["--tenants", str(tenants), "--router-secret-file", str(workdir / "secret")]
    args += ["--limits-window-s", str(WINDOW_S)]
    router = RouterProc(f"router-{i}", "FRA", free_port(), args, workdir / f"router-{i}.log")
    router.start()
    return router


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, tiny_dirs: dict[str, str]) -> Iterator[Fleet]:
    workdir = tmp_path_factory.mktemp("fleet-limits")
    nats = JetStream(workdir).start()
    ledger = LedgerProc(workdir, nats.url, ["--db", str(workdir / "ledger.sqlite")])
    # the node's own limits are its backstop, per node and per minute; here they would hide the fleet's
    _tenants(workdir / "tenants.json", {})
    args = node_args(workdir, "fra-1", "FRA", nats.url, {"tiny": tiny_dirs["tiny"]})
    node = NodeProc("fra-1", "FRA", free_port(), [*args, "--preload", "tiny"], workdir / "fra-1.log")
    routers: list[RouterProc] = []
    try:
        ledger.start()
        node.start()
        node.wait_ready()
        limited = _tenants(workdir / "router-tenants.json", LIMITS)
        fleet_file = _fleet_file(workdir / "fleet.toml", node)
        routers = [_router(workdir, i, nats.url, fleet_file, limited) for i in range(3)]
        for router in routers:
            router.wait_ready()
        yield Fleet(routers, node, ledger)
    finally:
        for router in routers:
            router.stop()
        node.stop()
        ledger.stop()
        nats.stop()


def _body(user: str = "") -> dict[str, object]:
    return {"model": "tiny", "prompt": "hello", "max_tokens": 1, "user": user}


def _hammer(url: str, key: str, until: float, out: list[httpx.Response], body: dict[str, object]) -> None:
    with httpx.Client(headers={"Authorization": f"Bearer {key}"}, timeout=30) as client:
        while time.time() < until:
            out.append(client.post(url + "/v1/completions", json=body))


def _through_all_routers(
    routers: list[RouterProc], tenant: str, body: dict[str, object] | None = None
) -> tuple[list, list, int]:
    """Each router's client sends `tenant`'s requests back to back from just after a window begins through
    two whole windows more: (responses per router, all responses, windows touched)."""
    time.sleep(WINDOW_S - time.time() % WINDOW_S + 0.05)
    start = time.time()
    until = start + 2 * WINDOW_S + 0.5
    results: list[list[httpx.Response]] = [[] for _ in routers]
    threads = [
        threading.Thread(target=_hammer, args=(r.url, KEYS[tenant], until, out, body or _body()))
        for r, out in zip(routers, results, strict=True)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    touched = int(time.time() // WINDOW_S) - int(start // WINDOW_S) + 1
    return results, [r for out in results for r in out], touched


def test_a_tenant_through_three_routers_gets_its_limit_per_window_across_the_fleet(
    fleet: Fleet,
) -> None:
    results, responses, touched = _through_all_routers(fleet.routers, "alice")
    admitted = sum(r.status_code == 200 for r in responses)
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
            client.post(fleet.routers[0].url + "/v1/completions", json=body).status_code == 200
            for _ in range(3)
        )


def test_under_its_limit_a_tenant_gets_every_request_through_any_router(fleet: Fleet) -> None:
    """dave sends 24 requests in one window, a third through each router, under his 30: all pass, though
    each router holds a slice of his budget that the others cannot spend meanwhile."""
    time.sleep(WINDOW_S - time.time() % WINDOW_S + 0.05)
    with httpx.Client(headers={"Authorization": f"Bearer {KEYS['dave']}"}, timeout=30) as client:
        codes = [client.post(fleet.routers[i % 3].url + "/v1/completions", json=_body()) for i in range(24)]
    assert [r.status_code for r in codes] == [200] * 24


def test_tokens_per_window_hold_across_the_fleet_and_settle_from_the_nodes_usage(fleet: Fleet) -> None:
    """carol's requests reserve far more than they use (a long `user` field inflates the router's estimate
    of the prompt, bytes / 4): the node's usage event gives the rest back, so many more pass than their
    reservations alone would let through; what they used never adds up to more than her limit per window."""
    body = _body(user="u" * 400)
    reserve = len(json.dumps(body)) // 4 + 1
    _, responses, touched = _through_all_routers(fleet.routers, "carol", body)
    ok = [r for r in responses if r.status_code == 200]
    used = sum(r.json()["usage"]["total_tokens"] for r in ok)
    assert used <= TOKEN_LIMIT * touched, (used, touched)
    assert len(ok) > touched * (TOKEN_LIMIT // reserve), (len(ok), reserve)


def test_the_routers_metrics_count_each_tenants_admissions_and_refusals(fleet: Fleet) -> None:
    text = "\n".join(httpx.get(r.url + "/metrics").text for r in fleet.routers)
    assert 'edgeinfer_router:tenant_admitted_requests_total{tenant="alice",via="fleet"}' in text
    assert 'edgeinfer_router:tenant_rejected_requests_total{limit="requests",tenant="alice"}' in text
    assert "edgeinfer_router:tenants_file_mismatch 0.0" in text


def test_usage_on_any_router_is_the_fleets_as_the_ledger_has_it(fleet: Fleet) -> None:
    """After the traffic above, every router answers alice's /v1/usage with the ledger's totals, which are
    the node's own record of what it served her."""
    headers = {"Authorization": f"Bearer {KEYS['alice']}"}
    own = httpx.get(fleet.node.url + "/v1/usage", headers=headers, timeout=10).json()
    assert own["total"]["requests"] > 0
    deadline = time.monotonic() + 10
    while True:  # events reach the ledger within milliseconds of the answer; allow for a busy machine
        answers = [httpx.get(r.url + "/v1/usage", headers=headers, timeout=10) for r in fleet.routers]
        if all(a.status_code == 200 and a.json()["total"] == own["total"] for a in answers):
            break
        assert time.monotonic() < deadline, ([a.text for a in answers], own)
        time.sleep(0.2)
    assert answers[0].json()["data"] == own["data"] and answers[0].json()["tenant"] == "alice"

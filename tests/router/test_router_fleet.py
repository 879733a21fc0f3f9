"""The router in front of real node processes on loopback: routing, spill-over, affinity, trust, failover."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from fleet_client import ALICE, ask, long_streams, metric, node_status, publishing, served_by, wait_until
from helpers.router_fleet import KEYS, SECRET, LoopbackFleet, RouterThread, write_tenants

from edgeinfer.api import router_trust
from edgeinfer.router.config import RouterConfig
from edgeinfer.router.placement import PlacementConfig
from edgeinfer.router.policy import PolicyConfig, rendezvous_order
from edgeinfer.types.status import NodeStatus

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def router(loopback_fleet: LoopbackFleet) -> Iterator[RouterThread]:
    config = RouterConfig(
        location="FRA",
        tenants_file=str(loopback_fleet.workdir / "tenants.json"),
        router_secret=SECRET,
        nats_url=loopback_fleet.nats_url,
        # Stale status takes 3 s here, so that after a SIGKILL it is the breaker that moves traffic.
        policy=PolicyConfig(stale_after_s=3.0, drop_after_s=30.0, busy_queue_depth=3),
        breaker_reset_s=0.5,
        placement=PlacementConfig(window_s=60.0, min_requests=3, near_rtt_s=0.005, interval_s=0.2),
        seed=0,
    )
    server = RouterThread(config, loopback_fleet.fleet()).start()
    server.wait_for_nodes(set(loopback_fleet.nodes))
    yield server
    server.stop()


def test_nodes_publish_status_on_nats_at_10_hz(loopback_fleet: LoopbackFleet):
    import nats

    async def count_for(seconds: float) -> dict[str, int]:
        nc = await nats.connect(loopback_fleet.nats_url)
        counts: dict[str, int] = {}

        async def on_message(msg: Any) -> None:
            status = NodeStatus.from_json(msg.data)
            counts[status.node_id] = counts.get(status.node_id, 0) + 1

        await nc.subscribe("edgeinfer.status.>", cb=on_message)
        await asyncio.sleep(seconds)
        await nc.close()
        return counts

    counts = asyncio.run(count_for(1.0))
    assert set(counts) == {"fra-1", "fra-2", "ams-1"}
    assert min(counts.values()) >= 8, counts
    status = NodeStatus.from_json(httpx.get(loopback_fleet.nodes["fra-1"].url + "/node/status").content)
    assert status.location == "FRA" and set(status.models_warm) == {"tiny", "tiny-b"}
    assert set(status.models_available) == {"tiny", "tiny-b", "tiny-c"} and status.capacity == 4


def test_nearest_location_with_the_model_warm(router: RouterThread):
    assert served_by(ask(router.url, location="FRA")).startswith("fra-")
    assert served_by(ask(router.url)).startswith("fra-")  # no header: the router's own location
    assert served_by(ask(router.url, location="AMS")) == "ams-1"
    assert served_by(ask(router.url, location="SIN")).startswith("fra-")  # FRA is nearer to SIN than AMS
    # tiny-c is warm only in AMS; loading it in FRA would cost more than the 7 ms to AMS.
    assert served_by(ask(router.url, "tiny-c", location="FRA")) == "ams-1"
    assert served_by(ask(router.url, "tiny-b", location="FRA")) == "fra-1"


def test_spill_over_when_saturated_and_back(router: RouterThread, loopback_fleet: LoopbackFleet):
    spilled_before = metric(router.url, "edgeinfer_router:spillovers_total", client_location="FRA")
    with long_streams(loopback_fleet.nodes["fra-1"].url, 5, "tiny-b"):
        wait_until(lambda: node_status(router, "fra-1").queue_depth >= 3, what="fra-1 saturated")
        assert served_by(ask(router.url, "tiny-b", location="FRA")) == "ams-1"
    wait_until(lambda: node_status(router, "fra-1").running == 0, what="fra-1 idle again")
    assert served_by(ask(router.url, "tiny-b", location="FRA")) == "fra-1"
    assert (
        metric(router.url, "edgeinfer_router:spillovers_total", client_location="FRA") == spilled_before + 1
    )


def test_status_page_in_headless_chromium(router: RouterThread, tmp_path):
    """Runs after the spill-over test, so the page has a spill-over to show."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("Debian's chromium is not installed")
    flags = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=4000"]
    dom = subprocess.run(
        [*flags, "--dump-dom", router.url + "/status"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    for expected in (
        'data-location="FRA"',
        'data-location="SIN"',
        "fra-1",
        "ams-1",
        "tiny-b",
        "breaker closed",
    ):
        assert expected in dom, expected
    assert '<span class="badge never">never reported</span>' in dom  # sin-1 has not reported yet
    assert re.search(r"<td>tiny-b</td><td>FRA</td><td>ams-1 \(AMS\)</td>", dom)  # the spill-over
    shot = tmp_path / "status.png"
    subprocess.run(
        [*flags, "--window-size=1100,700", f"--screenshot={shot}", router.url + "/status"],
        capture_output=True,
        timeout=120,
        check=True,
    )
    assert shot.stat().st_size > 10_000
    if os.environ.get("EDGEINFER_SAVE_SCREENSHOT"):
        shutil.copy(shot, os.environ["EDGEINFER_SAVE_SCREENSHOT"])


def test_affinity_sticks_with_headroom_and_moves_without(router: RouterThread, loopback_fleet: LoopbackFleet):
    owner, other = rendezvous_order("alice/session-7", ["fra-1", "fra-2"])
    assert {served_by(ask(router.url, affinity="session-7")) for _ in range(6)} == {owner}
    # 4 streams: 2 run, 2 wait; over the load bound of either node, under the busy threshold (3 waiting).
    with long_streams(loopback_fleet.nodes[owner].url, 4, "tiny"):
        wait_until(lambda: node_status(router, owner).queue_depth >= 2, what=f"{owner} loaded")
        assert served_by(ask(router.url, affinity="session-7")) == other
    wait_until(lambda: node_status(router, owner).running == 0, what=f"{owner} idle again")
    assert served_by(ask(router.url, affinity="session-7")) == owner


# What cannot be placed is answered by the router itself, as the node would; the rest of a generation
# request is the node's to judge (router/generation.py): its 4xx comes back as it gave it.
UNROUTABLE = [
    ("/v1/completions", b"{not json", {}),
    ("/v1/completions", b'{"prompt": "hi"}', {}),
    ("/v1/completions", b'{"model": "tiny", "prompt": "hi", "max_tokens": 0}', {}),
    ("/v1/completions", b'{"model": "tiny", "prompt": "hi"}', {"authorization": "Bearer wrong"}),
    ("/v1/completions", b'{"model": "tiny", "prompt": "' + b"x" * (4 * 1024 * 1024) + b'"}', {}),
    ("/v1/chat/completions", b'{"model": 7, "messages": []}', {}),
    ("/accounts/a/ai/run/tiny", b'{"prompt": "hi", "lora": 3}', {}),
]
JUDGED_BY_THE_NODE = [
    ("/v1/completions", b'{"model": "tiny", "prompt": "hi", "suffix": "x"}', {}),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": []}', {}),
    (
        "/v1/chat/completions",
        b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "tools": [1]}',
        {},
    ),
    ("/accounts/a/ai/run/tiny", b'{"prompt": "hi", "messages": [{"role": "user", "content": "x"}]}', {}),
    ("/accounts/a/ai/run/tiny", b'{"prompt": "hi", "temperature": -1}', {}),
]


@pytest.mark.parametrize(
    ("path", "body", "headers", "forwarded"),
    [(*case, False) for case in UNROUTABLE] + [(*case, True) for case in JUDGED_BY_THE_NODE],
)
def test_malformed_bodies_get_the_nodes_4xx(
    router: RouterThread,
    loopback_fleet: LoopbackFleet,
    path: str,
    body: bytes,
    headers: dict[str, str],
    forwarded: bool,
):
    sent = {"content-type": "application/json", **ALICE, **headers}
    routed = metric(router.url, "edgeinfer_router:routed_requests_total")
    via_router = httpx.post(router.url + path, content=body, headers=sent)
    direct = httpx.post(loopback_fleet.nodes["fra-1"].url + path, content=body, headers=sent)
    assert 400 <= direct.status_code < 500
    assert (via_router.status_code, via_router.json()) == (direct.status_code, direct.json())
    assert metric(router.url, "edgeinfer_router:routed_requests_total") == routed + forwarded


def usage_requests(node_url: str, tenant: str) -> int:
    headers = {"authorization": f"Bearer {KEYS[tenant]}"}
    return int(httpx.get(node_url + "/v1/usage", headers=headers).json()["total"]["requests"])


def test_forged_tenant_header_is_ignored(router: RouterThread, loopback_fleet: LoopbackFleet):
    ams = loopback_fleet.nodes["ams-1"].url
    before = {t: usage_requests(ams, t) for t in KEYS}
    forged = {
        **ALICE,
        "x-client-location": "AMS",
        **router_trust.signed_headers(b"x" * 32, "bob", time.time()),
    }
    response = httpx.post(
        router.url + "/v1/completions", json={"model": "tiny", "prompt": "Hi"}, headers=forged
    )
    assert served_by(response) == "ams-1"
    assert {t: usage_requests(ams, t) for t in KEYS} == {"alice": before["alice"] + 1, "bob": before["bob"]}
    # Straight to a node, a forged signature is refused; the routers' signature is honoured without a key.
    direct = httpx.post(ams + "/v1/completions", json={"model": "tiny", "prompt": "Hi"}, headers=forged)
    assert direct.status_code == 401
    signed = router_trust.signed_headers(SECRET, "bob", time.time())
    assert httpx.post(
        ams + "/v1/completions", json={"model": "tiny", "prompt": "Hi"}, headers=signed
    ).is_success
    assert usage_requests(ams, "bob") == before["bob"] + 1
    # Only routers may ask a node to load a model.
    assert httpx.post(ams + "/node/prefetch", json={"model": "tiny"}, headers=forged).status_code == 403


def test_client_disconnect_aborts_the_generation_on_the_node(
    router: RouterThread, loopback_fleet: LoopbackFleet
):
    ams = loopback_fleet.nodes["ams-1"].url
    aborted = metric(ams, "edgeinfer:request_outcomes_total", model="tiny-c", code="499")
    body = {"model": "tiny-c", "prompt": "Hello", "max_tokens": 3500, "ignore_eos": True, "stream": True}
    with httpx.stream(
        "POST", router.url + "/v1/completions", json=body, headers=ALICE, timeout=60
    ) as response:
        assert response.headers["x-edgeinfer-node"] == "ams-1"
        next(response.iter_raw())
    wait_until(lambda: metric(ams, "edgeinfer:request_outcomes_total", model="tiny-c", code="499") > aborted)
    wait_until(lambda: node_status(router, "ams-1").running == 0, timeout=5, what="ams-1 aborted the stream")


def test_emulated_rtt_delays_forwards_by_the_distance(loopback_fleet: LoopbackFleet):
    config = RouterConfig(
        location="FRA", tenants_file=str(loopback_fleet.workdir / "tenants.json"), emulate_rtt=True
    )
    config = dataclasses.replace(config, nats_url=loopback_fleet.nats_url, router_secret=SECRET)
    server = RouterThread(config, loopback_fleet.fleet(rtt_ms={"FRA-AMS": 300.0})).start()

    def elapsed(location: str) -> float:
        start = time.monotonic()
        assert served_by(ask(server.url, "tiny-c", location=location)) == "ams-1"
        return time.monotonic() - start

    try:
        server.wait_for_nodes(set(loopback_fleet.nodes))
        far = min(elapsed("FRA") for _ in range(3))  # tiny-c is warm only in AMS: 300 ms away
        near = min(elapsed("AMS") for _ in range(3))
        assert far >= 0.3 > near
    finally:
        server.stop()


def test_sustained_demand_loads_a_cold_model_nearby(router: RouterThread):
    """tiny-c is warm only in AMS, 12.3 ms from FRA: beyond this router's 5 ms "nearby", so FRA's demand
    for it makes the placement loop ask fra-1 (which has it cold) to load it."""
    assert "tiny-c" not in node_status(router, "fra-1").models_warm
    served = []
    deadline = time.monotonic() + 30
    while "tiny-c" not in node_status(router, "fra-1").models_warm and time.monotonic() < deadline:
        served.append(served_by(ask(router.url, "tiny-c", location="FRA")))
        time.sleep(0.1)
    assert served[0] == "ams-1" and "tiny-c" in node_status(router, "fra-1").models_warm
    assert served_by(ask(router.url, "tiny-c", location="FRA")) == "fra-1"


def test_polling_router_without_a_broker(loopback_fleet: LoopbackFleet, tmp_path):
    config = RouterConfig(location="AMS", tenants_file=str(write_tenants(tmp_path)), seed=1)
    server = RouterThread(config, loopback_fleet.fleet()).start()
    try:
        server.wait_for_nodes(set(loopback_fleet.nodes))
        assert served_by(ask(server.url)) == "ams-1"
        assert served_by(ask(server.url, "tiny-b", location="FRA")) == "fra-1"
    finally:
        server.stop()


def test_breaker_opens_on_a_dead_node_and_closes_when_it_returns(
    router: RouterThread, loopback_fleet: LoopbackFleet
):
    """sin-1 reports itself idle on the bus but nothing listens on its port yet."""
    late = loopback_fleet.late["sin-1"]
    ghost = NodeStatus("sin-1", "SIN", ("tiny",), ("tiny",), capacity=4)
    breaker = router.service.state.nodes["sin-1"].breaker
    with publishing(loopback_fleet.nats_url, ghost):
        router.wait_for_nodes({"sin-1"})
        retries = metric(router.url, "edgeinfer_router:retries_total")
        for _ in range(3):  # sin-1 ranks first for SIN clients: each attempt fails, the retry succeeds
            assert served_by(ask(router.url, location="SIN")).startswith("fra-")
        assert breaker.state == "open"
        assert metric(router.url, "edgeinfer_router:breaker_state", node="sin-1") == 2.0
        assert metric(router.url, "edgeinfer_router:retries_total") == retries + 3
        assert served_by(ask(router.url, location="SIN")).startswith("fra-")  # open: not even tried
        assert metric(router.url, "edgeinfer_router:retries_total") == retries + 3
        time.sleep(0.6)  # past breaker_reset_s: the next request probes it, fails, and re-opens it
        assert served_by(ask(router.url, location="SIN")).startswith("fra-")
        assert breaker.state == "open"
        late.start()
        late.wait_ready()
    time.sleep(0.6)
    assert served_by(ask(router.url, location="SIN")) == "sin-1"
    assert breaker.state == "closed"
    assert metric(router.url, "edgeinfer_router:breaker_state", node="sin-1") == 0.0
    late.stop()


def test_sigkill_under_traffic(router: RouterThread, loopback_fleet: LoopbackFleet):
    victim = loopback_fleet.nodes["fra-2"]
    pinned = next(
        f"s{i}" for i in range(100) if rendezvous_order(f"alice/s{i}", ["fra-1", "fra-2"])[0] == "fra-2"
    )
    cut = _open_pinned_stream(router.url, pinned)  # in flight on fra-2 when it dies
    results: list[dict[str, Any]] = []
    stop = threading.Event()

    def traffic(worker: int) -> None:
        with httpx.Client(timeout=60) as client:
            i = 0
            while not stop.is_set():
                results.append(_one_request(client, router.url, stream=(worker + i) % 2 == 0))
                i += 1

    with ThreadPoolExecutor(4) as pool:
        try:
            for w in range(4):
                pool.submit(traffic, w)
            wait_until(lambda: len(results) >= 100, 60, "traffic over every node")
            killed_at = time.monotonic()
            victim.kill()
            assert _finishes_cleanly(cut) is False  # cut short, never resumed on another node
            late_count = lambda: sum(r["start"] > killed_at + 0.5 for r in results)  # noqa: E731
            wait_until(lambda: late_count() >= 200, 60, "traffic after the kill")
        finally:
            stop.set()
    late = [r for r in results if r["start"] > killed_at + 0.5]
    assert late and all(r["ok"] and r["node"] != "fra-2" for r in late), late
    ok = sum(r["ok"] for r in results)
    assert ok >= 0.99 * len(results), [r for r in results if not r["ok"]]


def _one_request(client: httpx.Client, url: str, stream: bool) -> dict[str, Any]:
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 8, "stream": stream}
    start = time.monotonic()
    try:
        headers = {**ALICE, "x-client-location": "FRA"}
        response = client.post(url + "/v1/completions", json=body, headers=headers)
        ok = response.status_code == 200 and (not stream or response.text.rstrip().endswith("[DONE]"))
        return {"start": start, "ok": ok, "node": response.headers.get("x-edgeinfer-node")}
    except httpx.HTTPError as exc:
        return {"start": start, "ok": False, "node": None, "error": repr(exc)}


Stream = tuple[httpx.Client, httpx.Response, Iterator[bytes]]


def _open_pinned_stream(url: str, session: str) -> Stream:
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 3500, "ignore_eos": True, "stream": True}
    headers = {**ALICE, "x-session-affinity": session, "x-client-location": "FRA"}
    client = httpx.Client(timeout=60)
    request = client.build_request("POST", url + "/v1/completions", json=body, headers=headers)
    response = client.send(request, stream=True)
    assert response.headers["x-edgeinfer-node"] == "fra-2"
    chunks = response.iter_raw()
    next(chunks)
    return client, response, chunks


def _finishes_cleanly(stream: Stream) -> bool:
    client, response, chunks = stream
    try:
        text = b"".join(chunks).decode(errors="replace")
        return text.rstrip().endswith("[DONE]")
    except httpx.HTTPError:
        return False
    finally:
        response.close()
        client.close()


def test_the_signed_cache_salt_is_the_nodes_namespace(loopback_fleet: LoopbackFleet):
    """A node uses the salt a router signed as the tenant's namespace; a salt swapped in transit is a 401."""
    ams = loopback_fleet.nodes["ams-1"].url
    body = {"model": "tiny", "prompt": "salted prompt " * 12, "max_tokens": 2}

    def cached(salt: str, tamper: str | None = None) -> int | None:
        headers = router_trust.signed_headers(SECRET, "bob", time.time(), salt)
        if tamper is not None:
            headers["x-edgeinfer-cache-salt"] = tamper
        response = httpx.post(ams + "/v1/completions", json=body, headers=headers)
        if response.status_code == 401:
            return None
        assert response.status_code == 200, response.text
        return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    first_salt, other_salt = "a" * 64, "b" * 64
    assert cached(first_salt) == 0
    assert cached(first_salt) > 0  # the same salt: the same namespace
    assert cached(other_salt) == 0  # another salt (another tenant's, as the router derives it): no hit
    assert cached(first_salt, tamper=other_salt) is None

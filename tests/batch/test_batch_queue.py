"""The Batch API (Workers AI's `queueRequest=true`) end to end: a real nats-server with JetStream, two node
processes pulling from the queue, a router process queueing and polling. Each queued entry is answered
exactly once, with what the interactive route answers for the same body, to its own tenant only, also
when a node is killed with SIGKILL mid-run and restarted."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import nats
import numpy as np
import pytest
from helpers.embeddings import minilm_dir
from helpers.jetstream import JetStream
from helpers.router_fleet import KEYS, NodeProc, RouterProc, fra_fleet, free_port, node_args, write_tenants
from helpers.tiny_models import make_tiny

from edgeinfer.batch.store import WORK_STREAM, model_token

ACK_WAIT_S = 2.0  # a killed node's entries go to the other node after this
RUN_PATH = "/accounts/acct/ai/run/tiny"
PRICE = {"input": 100.0, "cached_input": 10.0, "output": 400.0, "batch": 0.5}  # batch work at half price


@dataclass
class Fleet:
    nodes: list[NodeProc]
    router: RouterProc
    nats_url: str
    workdir: Path


def _node(workdir: Path, node_id: str, nats_url: str, models: dict[str, str]) -> NodeProc:
    args = node_args(workdir, node_id, "FRA", nats_url, models)
    args += ["--prices", str(workdir / "prices.json")]
    args += ["--preload", "tiny", "--batch-ack-wait", str(ACK_WAIT_S)]
    # One thread each: two nodes' spinning OpenMP workers on two cores would slow both many times over.
    args += ["--threads", "1"]
    return NodeProc(node_id, "FRA", free_port(), args, workdir / f"{node_id}.log")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    workdir = tmp_path_factory.mktemp("batch")
    model = str(make_tiny("llama", workdir / "tiny", seed=0, max_position_embeddings=4096))
    nats = JetStream(workdir).start()
    write_tenants(workdir)
    (workdir / "prices.json").write_text(json.dumps({"default": PRICE}))
    # fra-1 also serves the embedding model (loaded by the first entry for it)
    nodes = [_node(workdir, "fra-1", nats.url, {"tiny": model, "minilm": str(minilm_dir())})]
    nodes.append(_node(workdir, "fra-2", nats.url, {"tiny": model}))
    try:
        with fra_fleet(workdir, nats.url, nodes) as router:
            yield Fleet(nodes, router, nats.url, workdir)
    finally:
        nats.stop()


def _client(url: str, tenant: str) -> httpx.Client:
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEYS[tenant]}"}, timeout=30)


def _entry(i: int, max_tokens: int = 8) -> dict[str, Any]:
    body: dict[str, Any] = {
        "prompt": f"entry {i}: the",
        "raw": True,
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    return {**body, "external_reference": f"ref-{i}"}


def _submit(client: httpx.Client, entries: list[dict[str, Any]], model_path: str = RUN_PATH) -> str:
    r = client.post(model_path, params={"queueRequest": "true"}, json={"requests": entries})
    assert r.status_code == 200, r.text
    result = r.json()["result"]
    assert result["status"] == "queued"
    return result["request_id"]


def _poll(client: httpx.Client, request_id: str, model_path: str = RUN_PATH) -> httpx.Response:
    return client.post(model_path, params={"queueRequest": "true"}, json={"request_id": request_id})


def _until_done(
    client: httpx.Client, request_id: str, timeout: float = 120.0, model_path: str = RUN_PATH
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = _poll(client, request_id, model_path)
        assert r.status_code == 200, r.text
        result = r.json()["result"]
        if "responses" in result:
            return result
        assert result["status"] in ("queued", "running")
        time.sleep(0.2)
    raise AssertionError(f"batch {request_id} not done in {timeout} s: {result}")


def _interactive(client: httpx.Client, entry: dict[str, Any]) -> str:
    body = {k: v for k, v in entry.items() if k != "external_reference"}
    r = client.post(RUN_PATH, json=body)
    assert r.status_code == 200, r.text
    return r.json()["result"]["response"]


def test_a_batch_on_a_node_answers_what_the_route_answers(fleet: Fleet) -> None:
    """Submitted and polled at a node: the results in order, each the interactive route's own answer
    (greedy), with its external reference and usage, and the batch's total usage."""
    entries = [_entry(i) for i in range(6)]
    with _client(fleet.nodes[0].url, "alice") as alice:
        request_id = _submit(alice, entries)
        result = _until_done(alice, request_id)
        expected = [_interactive(alice, e) for e in entries]
    responses = result["responses"]
    assert [r["id"] for r in responses] == list(range(6))
    assert [r["external_reference"] for r in responses] == [f"ref-{i}" for i in range(6)]
    assert all(r["success"] and not r["errors"] for r in responses)
    assert [r["result"]["response"] for r in responses] == expected
    completion = sum(r["result"]["usage"]["completion_tokens"] for r in responses)
    assert completion == result["usage"]["completion_tokens"] > 0


def test_200_entries_exactly_once_while_a_node_is_killed(fleet: Fleet) -> None:
    """Through the router, two tenants' batches while one node is killed with SIGKILL mid-run and then
    restarted: every entry answered once, correctly, and each tenant's poll shows only its own batch."""
    alice_entries = [_entry(i, max_tokens=24) for i in range(150)]
    bob_entries = [_entry(1000 + i, max_tokens=24) for i in range(50)]
    victim = fleet.nodes[1]
    before = asyncio.run(_deliveries(fleet.nats_url))
    with _client(fleet.router.url, "alice") as alice, _client(fleet.router.url, "bob") as bob:
        alice_id = _submit(alice, alice_entries)
        bob_id = _submit(bob, bob_entries)
        _until_progress(alice, alice_id, 20)
        _until_running(victim)  # killed with entries in flight
        victim.kill()
        _until_progress(alice, alice_id, 60)
        victim.start()
        victim.wait_ready()
        alice_result = _until_done(alice, alice_id, timeout=240)
        bob_result = _until_done(bob, bob_id, timeout=240)
        # another tenant's id is the same 404 as an unknown one, on the router and on a node
        for client, foreign in ((bob, alice_id), (alice, bob_id)):
            r, unknown = _poll(client, foreign), _poll(client, "no-such-id")
            assert r.status_code == unknown.status_code == 404, r.text
            assert r.json()["errors"] == [{**unknown.json()["errors"][0], "message": _not_found(foreign)}]
        with _client(fleet.nodes[0].url, "bob") as bob_at_node:
            assert _poll(bob_at_node, alice_id).status_code == 404
        spot = [alice_entries[0], alice_entries[149], bob_entries[7]]
        expected = [_interactive(alice, e) for e in spot]
    for result, entries in ((alice_result, alice_entries), (bob_result, bob_entries)):
        responses = result["responses"]
        assert [r["id"] for r in responses] == list(range(len(entries)))
        assert [r["external_reference"] for r in responses] == [e["external_reference"] for e in entries]
        assert all(r["success"] for r in responses), [r for r in responses if not r["success"]][:3]
    got = [alice_result["responses"][0], alice_result["responses"][149], bob_result["responses"][7]]
    assert [r["result"]["response"] for r in got] == expected
    # the kill did catch entries in flight: JetStream delivered some entries twice (and each answered once)
    assert asyncio.run(_deliveries(fleet.nats_url)) - before > 200


async def _deliveries(nats_url: str) -> int:
    """Deliveries so far (redeliveries included) by the queue's consumer for model `tiny`."""
    nc = await nats.connect(nats_url)
    try:
        info = await nc.jetstream().consumer_info(WORK_STREAM, f"batch-{model_token('tiny')}")
        return info.delivered.consumer_seq
    finally:
        await nc.close()


def _until_running(node: NodeProc, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while _running_gauge(httpx.get(node.url + "/metrics").text) == 0:
        assert time.monotonic() < deadline, f"{node.node_id} never ran an entry"
        time.sleep(0.005)


def _not_found(request_id: str) -> str:
    return f"no queued request {request_id!r} for this account"


def _until_progress(client: httpx.Client, request_id: str, completed: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = _poll(client, request_id).json()["result"]
        if "responses" in result or result["completed"] >= completed:
            return
        time.sleep(0.05)
    raise AssertionError(f"batch {request_id} stuck below {completed}: {result}")


def test_a_model_no_node_serves_stays_queued_and_says_so(fleet: Fleet) -> None:
    with _client(fleet.router.url, "alice") as alice:
        path = "/accounts/acct/ai/run/nobody-serves-this"
        request_id = _submit(alice, [_entry(0)], model_path=path)
        time.sleep(0.5)
        r = _poll(alice, request_id, model_path=path)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["result"]["status"] == "queued" and body["result"]["completed"] == 0
    assert "no node serves model nobody-serves-this" in body["messages"][0]["message"]


@pytest.mark.parametrize("where", ["router", "node"])
@pytest.mark.parametrize(
    ("requests", "named"),
    [
        ([_entry(0), _entry(1), {"prompt": "x", "max_tokens": "many"}], "requests[2].max_tokens"),
        ([_entry(0), "not an object"], "requests[1]"),
        ([_entry(0), {"prompt": "x", "stream": True}], "requests[1].stream"),
        ([{"prompt": "x", "messages": [{"role": "user", "content": "y"}]}], "requests[0]"),
        ([], "requests"),
    ],
)
def test_a_malformed_batch_is_a_400_naming_the_entry(
    fleet: Fleet, where: str, requests: list[Any], named: str
) -> None:
    url = fleet.router.url if where == "router" else fleet.nodes[0].url
    with _client(url, "alice") as alice:
        r = alice.post(RUN_PATH, params={"queueRequest": "true"}, json={"requests": requests})
    assert r.status_code == 400, r.text
    assert r.headers["x-request-id"]
    message = r.json()["errors"][0]["message"]
    assert message.startswith(named), message


def test_batch_work_is_metered_at_the_batch_price(fleet: Fleet) -> None:
    """Each entry is one usage row on the node that ran it (endpoint `ai.run.batch`), priced at the
    prices file's batch factor; the same bodies sent interactively are billed in full."""
    entries = [_entry(500 + i) for i in range(4)]
    with _client(fleet.nodes[0].url, "bob") as bob:
        request_id = _submit(bob, entries)
        _until_done(bob, request_id)
        for e in entries:
            _interactive(bob, e)
    for node in fleet.nodes:
        httpx.get(
            node.url + "/v1/usage", headers={"Authorization": f"Bearer {KEYS['bob']}"}
        ).raise_for_status()
    rows = []
    for node in fleet.nodes:
        with sqlite3.connect(fleet.workdir / f"{node.node_id}.sqlite") as db:
            query = (
                "SELECT request_id, endpoint, input_tokens, cached_input_tokens, output_tokens, cost_units "
            )
            rows += db.execute(query + "FROM usage WHERE tenant = 'bob' AND status = 200").fetchall()
    batch = [r for r in rows if r[0].startswith(f"batch-{request_id}-")]
    assert sorted(r[0] for r in batch) == sorted(f"batch-{request_id}-{i}" for i in range(4))
    interactive = [r for r in rows if r[1] == "ai.run"]
    assert len(interactive) >= 4
    for _, endpoint, prompt, cached, output, cost in batch + interactive:
        full = (
            (prompt - cached) * PRICE["input"] + cached * PRICE["cached_input"] + output * PRICE["output"]
        ) / 1e6
        factor = PRICE["batch"] if endpoint == "ai.run.batch" else 1.0
        assert output > 0 and cost == pytest.approx(full * factor)


def test_a_batch_of_text_embeddings(fleet: Fleet) -> None:
    """Entries for an embedding model take `text` and come back as vectors, the route's own."""
    path = "/accounts/acct/ai/run/minilm"
    entries = [{"text": ["a red fox", "a blue whale"]}, {"text": "tea with lemon", "external_reference": "t"}]
    with _client(fleet.router.url, "alice") as alice:
        r = alice.post(path, params={"queueRequest": "true"}, json={"requests": [{"prompt": "no text"}]})
        assert r.status_code == 400 and r.json()["errors"][0]["message"].startswith("requests[0]"), r.text
        request_id = _submit(alice, entries, model_path=path)
        result = _until_done(alice, request_id, model_path=path)
        direct = [alice.post(path, json=e).json()["result"] for e in entries]
    responses = result["responses"]
    assert [r["external_reference"] for r in responses] == [None, "t"]
    for got, want in zip(responses, direct, strict=True):
        assert got["success"] and got["result"]["shape"] == want["shape"]
        np.testing.assert_allclose(got["result"]["data"], want["data"], atol=1e-5)


def test_queued_work_is_not_load_that_routers_see(fleet: Fleet) -> None:
    """While entries run, the engines' gauges count them, but the status a node publishes for routers does
    not: they give way to any interactive request, so a node busy with queued work is not a busy node."""
    entries = [_entry(700 + i, max_tokens=400) for i in range(8)]
    seen = False
    with _client(fleet.nodes[0].url, "alice") as alice:
        request_id = _submit(alice, entries)
        deadline = time.monotonic() + 60
        while not seen and time.monotonic() < deadline:
            for node in fleet.nodes:
                gauge = _running_gauge(httpx.get(node.url + "/metrics").text)
                status = httpx.get(node.url + "/node/status").json()
                if gauge > 0:
                    seen = True
                    assert status["running"] == 0 and status["queue_depth"] == 0, status
        _until_done(alice, request_id)
    assert seen, "no entry was ever seen running"


def _running_gauge(metrics: str) -> float:
    lines = [ln for ln in metrics.splitlines() if ln.startswith("edgeinfer:num_requests_running")]
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in lines)

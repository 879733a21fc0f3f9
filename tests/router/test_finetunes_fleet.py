"""Finetunes across a fleet: a real nats-server with JetStream, two node processes and a router process. A
finetune created and uploaded through the router lands on the fleet's store, so each node serves it (the
same answer from both, other than the base's), and the router places requests naming it on the node that
holds it loaded; another tenant sees none of it."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from helpers.jetstream import JetStream
from helpers.lora import make_adapter
from helpers.router_fleet import KEYS, NodeProc, RouterProc, fra_fleet, free_port, node_args, write_tenants
from helpers.tiny_models import make_tiny

from edgeinfer.api.adapters import adapter_key

FILES = ("adapter_config.json", "adapter_model.safetensors")
BODY = {"prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0, "ignore_eos": True}


def _client(url: str, tenant: str) -> httpx.Client:
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEYS[tenant]}"}, timeout=60)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[list[NodeProc], RouterProc, Path]]:
    workdir = tmp_path_factory.mktemp("finetunes-fleet")
    model = str(make_tiny("llama", workdir / "tiny", seed=0))
    make_adapter(model, workdir / "adapter", ["q_proj", "v_proj", "down_proj"], seed=7)
    nats = JetStream(workdir).start()
    write_tenants(workdir)
    nodes = []
    for node_id in ("fra-1", "fra-2"):
        args = node_args(workdir, node_id, "FRA", nats.url, {"tiny": model})
        args += ["--preload", "tiny", "--threads", "1"]  # two nodes on two cores: one thread each
        nodes.append(NodeProc(node_id, "FRA", free_port(), args, workdir / f"{node_id}.log"))
    try:
        with fra_fleet(workdir, nats.url, nodes) as router:
            yield nodes, router, workdir / "adapter"
    finally:
        nats.stop()


def test_a_finetune_uploaded_through_the_router_serves_on_every_node(fleet):
    nodes, router, adapter = fleet
    with _client(router.url, "alice") as alice:
        created = alice.post("/accounts/a/ai/finetunes", json={"model": "tiny", "name": "support"})
        assert created.status_code == 200, created.text
        finetune = created.json()["result"]
        for name in FILES:
            r = alice.post(
                f"/accounts/a/ai/finetunes/{finetune['id']}/finetune-assets",
                files={"file": (name, (adapter / name).read_bytes())},
                data={"file_name": name},
            )
            assert r.status_code == 200, r.text
        listed = alice.get("/accounts/a/ai/finetunes").json()["result"]
        assert [f["name"] for f in listed] == ["support"]
        routed = alice.post("/v1/completions", json={**BODY, "model": "tiny:support"})
        assert routed.status_code == 200, routed.text
        # the node that served it reports the adapter loaded; the router then sends its requests there
        first = routed.headers["x-edgeinfer-node"]
        key = adapter_key("alice", "support")
        _until(lambda: key in httpx.get(_url(nodes, first) + "/node/status").json()["adapters_warm"])
        time.sleep(0.5)  # a few statuses on the bus
        again = [alice.post("/v1/completions", json={**BODY, "model": "tiny:support"}) for _ in range(6)]
        assert {r.headers["x-edgeinfer-node"] for r in again} == {first}
        base = alice.post("/v1/completions", json={**BODY, "model": "tiny"}).json()["choices"][0]["text"]
    texts = {routed.json()["choices"][0]["text"]}
    for node in nodes:  # each node finds it on the fleet's store, by name and by id
        with _client(node.url, "alice") as direct:
            by_name = direct.post("/v1/completions", json={**BODY, "model": "tiny:support"})
            wai = direct.post("/accounts/a/ai/run/tiny", json={**BODY, "raw": True, "lora": finetune["id"]})
        assert by_name.status_code == 200 and wai.status_code == 200, (by_name.text, wai.text)
        texts |= {by_name.json()["choices"][0]["text"], wai.json()["result"]["response"]}
    assert len(texts) == 1 and base not in texts

    with _client(router.url, "bob") as bob:
        assert bob.get("/accounts/b/ai/finetunes").json()["result"] == []
        assert bob.post("/v1/completions", json={**BODY, "model": "tiny:support"}).status_code == 404
        upload = bob.post(
            f"/accounts/b/ai/finetunes/{finetune['id']}/finetune-assets",
            files={"file": (FILES[0], (adapter / FILES[0]).read_bytes())},
            data={"file_name": FILES[0]},
        )
        assert upload.status_code == 404
        unknown = bob.post("/accounts/b/ai/finetunes", json={"model": "nope", "name": "x"})
        assert unknown.status_code == 404


def _url(nodes: list[NodeProc], node_id: str) -> str:
    return next(n.url for n in nodes if n.node_id == node_id)


def _until(check: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)

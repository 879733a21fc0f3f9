"""Embeddings through the router, in front of real node processes with the real all-MiniLM-L6-v2: routed
to a node with the embedding model warm, with the same tenants, validation and metrics as generation."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import numpy as np
import pytest
from fleet_client import ALICE, metric, node_status
from helpers.embeddings import minilm_dir
from helpers.router_fleet import (
    KEYS,
    SECRET,
    LoopbackFleet,
    NodeProc,
    RouterThread,
    free_port,
    node_args,
    write_tenants,
)

from edgeinfer.fleet.nats_server import start_nats
from edgeinfer.router.config import RouterConfig

pytestmark = pytest.mark.timeout(300)
ALIAS = "@cf/sentence-transformers/all-minilm-l6-v2"
TEXTS = ["The cat sat on the mat.", "Edge inference close to users."]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, tiny_dirs: dict[str, str]) -> Iterator[LoopbackFleet]:
    """fra-e: tiny warm, minilm cold; ams-e: minilm warm (and tiny)."""
    workdir = tmp_path_factory.mktemp("embed-fleet")
    write_tenants(workdir)
    port = free_port()
    nats = start_nats(port, workdir / "nats.log")
    fleet = LoopbackFleet(workdir, f"nats://127.0.0.1:{port}")
    models = {"tiny": tiny_dirs["tiny"], "minilm": str(minilm_dir())}
    layout = {"fra-e": ("FRA", ["tiny"]), "ams-e": ("AMS", ["minilm", "tiny"])}
    try:
        for node_id, (location, preload) in layout.items():
            args = node_args(workdir, node_id, location, fleet.nats_url, models)
            args += ["--alias", f"{ALIAS}=minilm", "--preload", *preload]
            node = NodeProc(node_id, location, free_port(), args, workdir / f"{node_id}.log")
            node.start()
            fleet.nodes[node_id] = node
        for node in fleet.nodes.values():
            node.wait_ready()
        yield fleet
    finally:
        for node in fleet.nodes.values():
            node.stop()
        nats.terminate()
        nats.wait(10)


@pytest.fixture(scope="module")
def router(fleet: LoopbackFleet) -> Iterator[RouterThread]:
    config = RouterConfig(
        location="FRA",
        tenants_file=str(fleet.workdir / "tenants.json"),
        router_secret=SECRET,
        nats_url=fleet.nats_url,
        placement=None,  # minilm stays cold in FRA: the test is about routing, not loading
        seed=0,
    )
    server = RouterThread(config, fleet.fleet()).start()
    server.wait_for_nodes(set(fleet.nodes))
    yield server
    server.stop()


def test_node_status_reports_embedding_models_and_whether_warm(router: RouterThread):
    ams, fra = node_status(router, "ams-e"), node_status(router, "fra-e")
    assert set(ams.models_embedding) == set(fra.models_embedding) == {"minilm", ALIAS}
    assert {"minilm", ALIAS} <= set(ams.models_warm)
    assert "minilm" not in fra.models_warm and "minilm" in fra.models_available


def test_openai_embeddings_go_to_the_node_with_the_model_warm(router: RouterThread, fleet: LoopbackFleet):
    body = {"model": "minilm", "input": TEXTS}
    routed = httpx.post(
        router.url + "/v1/embeddings", json=body, headers={**ALICE, "x-client-location": "FRA"}, timeout=60
    )
    assert routed.status_code == 200, routed.text
    # Loading minilm in FRA (cold) would cost more than the few ms to AMS, where it is warm.
    assert routed.headers["x-edgeinfer-node"] == "ams-e"
    direct = httpx.post(fleet.nodes["ams-e"].url + "/v1/embeddings", json=body, headers=ALICE, timeout=60)
    got = np.array([d["embedding"] for d in routed.json()["data"]])
    want = np.array([d["embedding"] for d in direct.json()["data"]])
    assert got.shape == (2, 384)
    np.testing.assert_allclose(got, want, atol=1e-6)
    assert routed.json()["usage"]["prompt_tokens"] == direct.json()["usage"]["prompt_tokens"] > 0
    # Generation from the same client stays in FRA.
    gen = httpx.post(
        router.url + "/v1/completions",
        json={"model": "tiny", "prompt": "Hi", "max_tokens": 2},
        headers=ALICE,
        timeout=60,
    )
    assert gen.status_code == 200 and gen.headers["x-edgeinfer-node"] == "fra-e"


def test_workers_ai_text_embeddings_and_generation_share_the_route(router: RouterThread):
    url = router.url + "/accounts/acct/ai/run/"
    vectors = httpx.post(url + ALIAS, json={"text": TEXTS}, headers=ALICE, timeout=60)
    assert vectors.status_code == 200, vectors.text
    assert vectors.headers["x-edgeinfer-node"] == "ams-e"
    result = vectors.json()["result"]
    assert result["shape"] == [2, 384] and len(result["data"][1]) == 384
    text = httpx.post(url + "tiny", json={"prompt": "Hi", "max_tokens": 2}, headers=ALICE, timeout=60)
    assert text.status_code == 200 and "response" in text.json()["result"], text.text
    # A generation body for the embedding model is the node's 400, from the router.
    wrong = httpx.post(url + ALIAS, json={"prompt": "Hi"}, headers=ALICE, timeout=60)
    assert wrong.status_code == 400 and wrong.json()["success"] is False
    assert "text" in wrong.json()["errors"][0]["message"]


@pytest.mark.parametrize(
    "body",
    [
        {"model": "minilm", "input": []},
        {"model": "minilm", "input": ["ok", ""]},
        {"model": "minilm", "input": ["x"] * 100_000},
        {"model": "minilm"},
    ],
    ids=["empty-list", "empty-string", "100k-items", "no-input"],
)
def test_bad_embedding_bodies_get_the_nodes_4xx_without_reaching_a_node(
    router: RouterThread, fleet: LoopbackFleet, body: dict
):
    routed_before = metric(router.url, "edgeinfer_router:routed_requests_total")
    via_router = httpx.post(router.url + "/v1/embeddings", json=body, headers=ALICE, timeout=60)
    direct = httpx.post(fleet.nodes["ams-e"].url + "/v1/embeddings", json=body, headers=ALICE, timeout=60)
    assert 400 <= via_router.status_code < 500
    assert via_router.status_code == direct.status_code
    assert via_router.json() == direct.json()
    assert metric(router.url, "edgeinfer_router:routed_requests_total") == routed_before


def test_embeddings_need_a_key_and_reach_the_node_as_the_tenant(router: RouterThread, fleet: LoopbackFleet):
    body = {"model": "minilm", "input": "hello"}
    anonymous = httpx.post(router.url + "/v1/embeddings", json=body, timeout=60)
    assert anonymous.status_code == 401
    forged = {
        **ALICE,
        "x-edgeinfer-tenant": "bob",
        "x-edgeinfer-tenant-ts": "0",
        "x-edgeinfer-tenant-sig": "0",
    }
    ok = httpx.post(router.url + "/v1/embeddings", json=body, headers=forged, timeout=60)
    assert ok.status_code == 200, ok.text
    node = fleet.nodes["ams-e"].url

    def usage(name: str) -> dict:
        answer = httpx.get(node + "/v1/usage", headers={"authorization": f"Bearer {KEYS[name]}"}, timeout=10)
        assert answer.status_code == 200, answer.text
        return answer.json()["total"]

    assert usage("alice")["input_tokens"] > 0
    assert usage("bob")["requests"] == 0  # the forged header was stripped; the router signed alice
    assert metric(router.url, "edgeinfer_router:routed_requests_total", node="ams-e", outcome="200") >= 1
    # The router's own share of the time to first byte is part of, and below, arrival-to-first-byte.
    added = metric(router.url, "edgeinfer_router:added_latency_seconds_sum")
    assert metric(router.url, "edgeinfer_router:added_latency_seconds_count") >= 1
    assert 0 < added < metric(router.url, "edgeinfer_router:first_byte_seconds_sum")

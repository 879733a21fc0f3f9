"""Fixtures of the router tests: tiny models and a loopback fleet (NATS, node processes); the classes live
in helpers/router_fleet.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from helpers.router_fleet import LoopbackFleet, NodeProc, free_port, node_args, write_tenants
from helpers.tiny_models import make_tiny

from edgeinfer.fleet.nats_server import start_nats


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Three tiny models with different weights; a long context so that streams can run for seconds."""
    root = tmp_path_factory.mktemp("router-tiny")
    return {
        name: str(make_tiny("llama", root / name, seed=seed, max_position_embeddings=4096))
        for seed, name in enumerate(("tiny", "tiny-b", "tiny-c"))
    }


@pytest.fixture(scope="module")
def loopback_fleet(
    tmp_path_factory: pytest.TempPathFactory, tiny_dirs: dict[str, str]
) -> Iterator[LoopbackFleet]:
    """fra-1 (tiny, tiny-b warm; tiny-c cold), fra-2 (tiny), ams-1 (all three warm); sin-1 (tiny) is in
    the fleet file but not started."""
    workdir = tmp_path_factory.mktemp("fleet")
    write_tenants(workdir)
    port = free_port()
    nats = start_nats(port, workdir / "nats.log")
    fleet = LoopbackFleet(workdir, f"nats://127.0.0.1:{port}")
    layout = {
        "fra-1": ("FRA", ["tiny", "tiny-b", "tiny-c"], ["tiny", "tiny-b"]),
        "fra-2": ("FRA", ["tiny"], ["tiny"]),
        "ams-1": ("AMS", ["tiny", "tiny-b", "tiny-c"], ["tiny", "tiny-b", "tiny-c"]),
    }
    try:
        for node_id, (location, models, preload) in layout.items():
            args = node_args(workdir, node_id, location, fleet.nats_url, {m: tiny_dirs[m] for m in models})
            node = NodeProc(
                node_id, location, free_port(), [*args, "--preload", *preload], workdir / f"{node_id}.log"
            )
            node.start()
            fleet.nodes[node_id] = node
        for node in fleet.nodes.values():
            node.wait_ready()
        args = node_args(workdir, "sin-1", "SIN", fleet.nats_url, {"tiny": tiny_dirs["tiny"]})
        fleet.late["sin-1"] = NodeProc(
            "sin-1", "SIN", free_port(), [*args, "--preload"], workdir / "sin-1.log"
        )
        yield fleet
    finally:
        for node in [*fleet.nodes.values(), *fleet.late.values()]:
            node.stop()
        nats.terminate()
        nats.wait(10)

"""Real node servers on loopback for the tests: uvicorn in a thread (or a subprocess), tiny checkpoints."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers.node_servers import LiveServer, NodeFactory, NodeProcesses
from helpers.tiny_models import make_tiny

from edgeinfer.api.keys import hash_key


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_tiny("llama", tmp_path_factory.mktemp("node-tiny") / "llama", seed=0))


@pytest.fixture(scope="session")
def tiny_llama_b_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A second tiny model with other weights, for pool tests."""
    return str(make_tiny("llama", tmp_path_factory.mktemp("node-tiny-b") / "llama-b", seed=1))


@pytest.fixture
def node_factory(tmp_path: Path) -> Iterator[NodeFactory]:
    factory = NodeFactory(tmp_path)
    yield factory
    for server in factory.servers:
        server.stop()


@pytest.fixture(scope="module")
def shared_node(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: str) -> Iterator[LiveServer]:
    """One open node with the tiny model preloaded, shared by a module's tests."""
    factory = NodeFactory(tmp_path_factory.mktemp("shared-node"))
    server = factory({"tiny": tiny_llama_dir}, aliases={"tiny": ("@cf/test/tiny",)}, preload=("tiny",))
    yield server
    server.stop()


def tenant_entry(name: str, key: str, **limits: int) -> dict[str, Any]:
    return {"name": name, "key_sha256": hash_key(key), **limits}


@pytest.fixture
def make_tenant() -> Callable[..., dict[str, Any]]:
    return tenant_entry


@pytest.fixture(scope="module")
def upstream_node(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: str) -> Iterator[str]:
    """A second edgeinfer, in its own process, serving the tiny model as "inner"; yields its URL."""
    procs = NodeProcesses(tmp_path_factory.mktemp("upstream"))
    yield procs.start(
        "--model",
        f"inner={tiny_llama_dir}",
        "--preload",
        "--dtype",
        "float32",
        "--kv-cache-memory",
        "256KiB",
        "--batch-window-ms",
        "0",
    )
    procs.stop()


@pytest.fixture(scope="module")
def module_node_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeFactory]:
    """Nodes shared by one module's tests (stopped after the module)."""
    factory = NodeFactory(tmp_path_factory.mktemp("module-node"))
    yield factory
    for server in factory.servers:
        server.stop()

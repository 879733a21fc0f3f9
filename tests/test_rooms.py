"""The rooms' import rules (docs/engine.md, the map of rooms): what both servers speak lives in `api`, which
imports neither server; the router reaches nodes over HTTP and NATS only, never through their code; the
node never imports the router; the ledger, the batch queue and the finetunes import only `api` and
`types`; the fleet simulator runs the router's own policy and network model; weight quantization
imports neither the eval harness nor attention; our CPU kernels are a leaf room (torch, the standard
library and the cache dir's location): model, quantization and attention call them, never the reverse."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import edgeinfer

SRC = Path(edgeinfer.__file__).parent

# Neither server's code, nor the engine's, pool's, fleet's or torch.
_NO_SERVER = (
    "edgeinfer.node",
    "edgeinfer.router",
    "edgeinfer.engine",
    "edgeinfer.pool",
    "edgeinfer.fleet",
    "torch",
)
# room -> module prefixes none of its files may import (at any depth, lazily inside functions too)
FORBIDDEN = {
    "api": _NO_SERVER,
    "router": ("edgeinfer.node", "edgeinfer.engine", "edgeinfer.pool", "torch"),
    "node": ("edgeinfer.router", "edgeinfer.fleet"),
    "fleet": ("edgeinfer.node", "edgeinfer.engine", "edgeinfer.pool", "torch"),
    # the ledger is one process for the whole fleet: it reads events off the bus, never a server's code
    "ledger": _NO_SERVER,
    # the batch queue is shared by nodes and routers: neither's code, nor the engine's
    "batch": _NO_SERVER,
    # so are the tenants' uploaded finetunes (the engine checks the weights where they serve)
    "finetunes": _NO_SERVER,
    # quantization alone: a calibration pass gets its forward from the caller, the corpus is its own room
    "engine/quant": ("edgeinfer.eval", "edgeinfer.engine.attention"),
    # the kernels are a leaf: the rooms that use them switch their own layers onto them
    "engine/kernels": (
        "edgeinfer.engine.model",
        "edgeinfer.engine.quant",
        "edgeinfer.engine.attention",
        "edgeinfer.engine.scheduler",
        "edgeinfer.node",
        "edgeinfer.router",
        "edgeinfer.api",
    ),
}
# Ours that a room may import at all (third-party libraries aside).
MAY_IMPORT = {
    "api": ("edgeinfer.api", "edgeinfer.types", "edgeinfer.structured"),
    "ledger": ("edgeinfer.ledger", "edgeinfer.api", "edgeinfer.types"),
    "batch": ("edgeinfer.batch", "edgeinfer.api", "edgeinfer.types"),
    "finetunes": ("edgeinfer.finetunes", "edgeinfer.api", "edgeinfer.types"),
}


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def _room_imports(room: str) -> dict[str, set[str]]:
    return {str(p.relative_to(SRC)): _imports(p) for p in (SRC / room).rglob("*.py")}


def _matches(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


@pytest.mark.parametrize("room", sorted(FORBIDDEN))
def test_room_imports_nothing_it_must_not(room: str) -> None:
    found = {
        f"{path}: {name}"
        for path, names in _room_imports(room).items()
        for name in names
        if _matches(name, FORBIDDEN[room])
    }
    assert not found


@pytest.mark.parametrize("room", sorted(MAY_IMPORT))
def test_room_imports_only_what_it_may_of_ours(room: str) -> None:
    found = {
        f"{path}: {name}"
        for path, names in _room_imports(room).items()
        for name in names
        if name.startswith("edgeinfer") and not _matches(name, MAY_IMPORT[room])
    }
    assert not found


def test_the_rule_sees_lazy_imports(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from edgeinfer.node.service import NodeService\n")
    assert _matches(next(iter(_imports(module))), FORBIDDEN["router"])

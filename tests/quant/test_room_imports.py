"""engine/quant holds quantization alone: it imports nothing of the eval harness nor of attention (a
calibration pass gets its forward from the caller, the corpus is its own room)."""

from __future__ import annotations

import ast
from pathlib import Path

import edgeinfer.engine.quant

FORBIDDEN = ("edgeinfer.eval", "edgeinfer.engine.attention")


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_quant_imports_neither_eval_nor_attention() -> None:
    room = Path(edgeinfer.engine.quant.__file__).parent
    found = {
        f"{path.relative_to(room)}: {name}"
        for path in room.rglob("*.py")
        for name in _imports(path)
        if name.startswith(FORBIDDEN)
    }
    assert not found

"""The attention implementations by name, readable without importing torch: the CLI offers the names as
choices and `EngineConfig` checks them before anything loads. Each entry is `module:class`, imported on
first use."""

from __future__ import annotations

import importlib
from collections.abc import Mapping

# Paged-attention backends (`AttentionBackend` subclasses). Every one listed here runs through
# tests/engine/test_attention_conformance.py.
ATTENTION_BACKENDS: Mapping[str, str] = {
    "torch": "edgeinfer.engine.attention.torch_backend:TorchPagedBackend",
}
DEFAULT_ATTENTION_BACKEND = "torch"

# How MLA models decode over their cache of latents (`LatentAttention` subclasses, mla.py); both are exact.
MLA_MODES: Mapping[str, str] = {
    "absorb": "edgeinfer.engine.attention.mla:AbsorbLatentAttention",
    "expand": "edgeinfer.engine.attention.mla:ExpandLatentAttention",
}
# Absorb never up-projects the context, and measured faster on CPU (docs/benchmarks.md, MoE decode).
DEFAULT_MLA_MODE = "absorb"


def check_name(table: Mapping[str, str], name: str, what: str) -> None:
    """A ValueError naming the known entries when `name` is not one of them."""
    if name not in table:
        raise ValueError(f"unknown {what} {name!r} (known: {', '.join(table)})")


def load_class(table: Mapping[str, str], name: str, what: str) -> type:
    """The class `name` stands for, its module imported now."""
    check_name(table, name, what)
    module, _, attr = table[name].partition(":")
    return getattr(importlib.import_module(module), attr)

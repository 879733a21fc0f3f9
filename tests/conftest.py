"""Shared fixtures: tiny checkpoints are built once per session into a temp dir."""

from __future__ import annotations

import pytest
from helpers.tiny_models import make_tiny


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny")
    return {fam: str(make_tiny(fam, root / fam)) for fam in ("llama", "qwen3", "gemma3")}


@pytest.fixture(scope="session")
def tiny_llama(tiny_models) -> str:
    return tiny_models["llama"]

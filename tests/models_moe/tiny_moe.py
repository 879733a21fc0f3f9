"""Tiny MoE checkpoints: `make_tiny` plus random router correction biases and attention biases.

HF initialises `e_score_correction_bias` and linear biases to zero; random ones make the tests sensitive
to where (and in what precision) each is applied.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from helpers.tiny_models import make_tiny
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

FAMILIES = ("qwen3_moe", "glm4_moe", "deepseek_v3", "deepseek_v3_full_q")
WEIGHTS = "model.safetensors"


def make_tiny_moe(family: str, path: Path, seed: int = 0, **overrides: Any) -> Path:
    make_tiny(family, path, seed=seed, **overrides)
    state = load_file(path / WEIGHTS)
    gen = torch.Generator().manual_seed(seed + 1)
    for name, tensor in state.items():
        if name.endswith((".bias", "e_score_correction_bias")):
            state[name] = torch.randn(tensor.shape, generator=gen, dtype=tensor.dtype) * 0.05
    save_file(state, path / WEIGHTS, metadata={"format": "pt"})
    return path


def with_fused_experts(src: Path, dst: Path) -> Path:
    """A copy of `src` whose routed experts are stored fused (`experts.gate_up_proj` [E, 2I, H]),
    as transformers v5 holds them in memory."""
    shutil.copytree(src, dst)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    assert any(k.endswith("experts.gate_up_proj") for k in state)
    save_file(state, dst / WEIGHTS, metadata={"format": "pt"})
    return dst


def as_kimi_k2(src: Path, dst: Path) -> Path:
    """A copy of a DeepSeek-V3 checkpoint with a config.json written as Kimi K2 ships it: model_type
    kimi_k2, rope as top-level `rope_theta` + legacy `rope_scaling`, explicit scoring/top-k method keys."""
    shutil.copytree(src, dst)
    cfg = json.loads((src / "config.json").read_text())
    rope = dict(cfg.pop("rope_parameters"))
    cfg["rope_theta"] = rope.pop("rope_theta")
    rope["type"] = rope.pop("rope_type")
    cfg.update(
        model_type="kimi_k2",
        rope_scaling=rope,
        scoring_func="sigmoid",
        topk_method="noaux_tc",
        moe_layer_freq=1,
    )
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst

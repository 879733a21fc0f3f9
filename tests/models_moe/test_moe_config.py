"""Config handling of the MoE families: KV layout per token, unsupported keys, checkpoint key variants."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from edgeinfer.engine.attention.mla import get_latent_attention
from edgeinfer.engine.config import EngineConfig
from edgeinfer.engine.engine import LLMEngine
from edgeinfer.engine.model.hf_config import ConfigError
from edgeinfer.engine.model.registry import build_model


def config(moe_models, family: str) -> dict:
    return json.loads((Path(moe_models[family]) / "config.json").read_text())


@pytest.mark.parametrize(
    ("family", "dtype", "values"),
    [
        ("qwen3_moe", "float32", 2 * 2 * 32),  # K and V: 2 KV heads x head_dim 32
        ("glm4_moe", "float32", 2 * 2 * 32),
        ("deepseek_v3", "float32", 32 + 8),  # one latent: kv_lora_rank + qk_rope_head_dim
        ("deepseek_v3_full_q", "bfloat16", 32 + 8),
    ],
)
def test_kv_bytes_per_token_per_layer_match_the_formula(family, dtype, values, moe_models):
    eng = LLMEngine(EngineConfig(model=moe_models[family], dtype=dtype, num_kv_blocks=8, batch_window_ms=0))
    cfg = config(moe_models, family)
    elem = 4 if dtype == "float32" else 2
    assert eng.layout.kv_bytes_per_token / cfg["num_hidden_layers"] == values * elem
    if "kv_lora_rank" in cfg:
        assert values == cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]
        storage = eng.runner.storage
        assert storage.v == [None] * cfg["num_hidden_layers"]  # no V pool at all: the latent is the cache
        assert storage.k[0].data.shape[2:] == (1, values)


@pytest.mark.parametrize(
    ("family", "key", "value"),
    [
        ("deepseek_v3", "scoring_func", "softmax"),
        ("deepseek_v3", "topk_method", "group_limited_greedy"),
        ("glm4_moe", "topk_method", "greedy"),
        ("glm4_moe", "moe_layer_freq", 2),
        ("qwen3_moe", "scoring_func", "sigmoid"),
        ("deepseek_v3", "n_group", 3),  # does not divide 8 experts
        ("glm4_moe", "topk_group", 5),  # more groups than n_group=4
        ("qwen3_moe", "num_experts_per_tok", 9),
        ("deepseek_v3", "hidden_act", "mish"),
        ("deepseek_v3", "rope_parameters", {"rope_type": "longrope", "rope_theta": 1e4}),
    ],
)
def test_unsupported_config_values_raise_config_error_naming_the_key(family, key, value, moe_models):
    cfg = {**config(moe_models, family), key: value}
    name = "rope_type" if key == "rope_parameters" else key
    with pytest.raises(ConfigError, match=name):
        build_model(cfg)


def test_the_engine_refuses_an_unsupported_router_with_one_line(moe_models, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(moe_models["deepseek_v3"], bad)
    cfg = {**config(moe_models, "deepseek_v3"), "topk_method": "greedy"}
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"unsupported topk_method 'greedy'") as err:
        LLMEngine(EngineConfig(model=str(bad), dtype="float32", num_kv_blocks=8))
    assert "\n" not in str(err.value)


def test_q_lora_rank_must_be_given_even_if_null(moe_models):
    cfg = config(moe_models, "deepseek_v3_full_q")
    assert cfg["q_lora_rank"] is None
    assert not hasattr(build_model(cfg).model.layers[0].self_attn, "q_a_proj")
    del cfg["q_lora_rank"]
    with pytest.raises(ConfigError, match="q_lora_rank"):
        build_model(cfg)


def test_unknown_mla_mode_is_refused():
    with pytest.raises(ValueError, match=r"unknown MLA mode 'fastest' \(known: absorb, expand\)"):
        EngineConfig(mla_mode="fastest")
    with pytest.raises(ValueError, match="unknown MLA mode 'fastest'"):
        get_latent_attention("fastest")
    assert get_latent_attention("expand").name == "expand"


def _tensors(moe_models, family: str) -> dict[str, torch.Tensor]:
    return load_file(Path(moe_models[family]) / "model.safetensors")


def test_multi_token_prediction_layers_are_skipped(moe_models):
    """DeepSeek-V3 / GLM-4.5 checkpoints carry an MTP layer after the last one; HF skips it, so do we."""
    cfg = config(moe_models, "deepseek_v3")
    tensors = _tensors(moe_models, "deepseek_v3")
    n = cfg["num_hidden_layers"]
    mtp = {
        k.replace(f"layers.{n - 1}.", f"layers.{n}."): v
        for k, v in tensors.items()
        if f"layers.{n - 1}." in k
    }
    model = build_model(cfg)
    model.load_weights({**tensors, **mtp, f"model.layers.{n}.eh_proj.weight": torch.zeros(2)}.items())
    assert torch.equal(
        model.model.layers[1].mlp.experts.down_proj[3],
        tensors["model.layers.1.mlp.experts.3.down_proj.weight"],
    )


def test_per_expert_keys_fill_the_fused_parameters(moe_models):
    cfg = config(moe_models, "glm4_moe")
    tensors = _tensors(moe_models, "glm4_moe")
    model = build_model(cfg)
    model.load_weights(tensors.items())
    gate_up = model.model.layers[2].mlp.experts.gate_up_proj
    assert gate_up.shape == (8, 2 * 32, 64)
    assert torch.equal(gate_up[5, :32], tensors["model.layers.2.mlp.experts.5.gate_proj.weight"])
    assert torch.equal(gate_up[5, 32:], tensors["model.layers.2.mlp.experts.5.up_proj.weight"])


def test_a_missing_expert_is_named(moe_models):
    tensors = _tensors(moe_models, "qwen3_moe")
    del tensors["model.layers.1.mlp.experts.6.up_proj.weight"]
    with pytest.raises(ValueError, match=r"lacks tensors .*layers\.1\.mlp\.experts\.gate_up_proj"):
        build_model(config(moe_models, "qwen3_moe")).load_weights(tensors.items())


@pytest.mark.parametrize("where", ["after", "before"])
def test_a_repeated_expert_is_named(where, moe_models):
    """A tensor given twice is refused, whether its stack was complete (and may have been quantized
    already) or not."""
    tensors = _tensors(moe_models, "qwen3_moe")
    name = "model.layers.1.mlp.experts.6.up_proj.weight"
    items = list(tensors.items())
    items.insert(len(items) if where == "after" else 0, (name, tensors[name]))
    with pytest.raises(ValueError, match=r"fills .*layers\.1\.mlp\.experts\.gate_up_proj.* twice"):
        build_model(config(moe_models, "qwen3_moe")).load_weights(items)


def test_an_expert_beyond_the_config_is_named(moe_models):
    tensors = _tensors(moe_models, "qwen3_moe")
    tensors["model.layers.1.mlp.experts.8.down_proj.weight"] = torch.zeros(64, 32)
    with pytest.raises(ValueError, match=r"experts\.8\.down_proj.*names expert 8; the model has 8"):
        build_model(config(moe_models, "qwen3_moe")).load_weights(tensors.items())


def test_bf16_serving_keeps_sigmoid_routers_in_fp32(moe_models):
    """As HF does: the correction bias decides near-ties between experts, bf16 rounding would flip them.
    The loader must hand the bias over unrounded, not cast to bf16 and back."""
    eng = LLMEngine(EngineConfig(model=moe_models["deepseek_v3"], dtype="bfloat16", num_kv_blocks=8))
    block = eng.model.model.layers[1].mlp
    stored = _tensors(moe_models, "deepseek_v3")
    assert block.experts.gate_up_proj.dtype == torch.bfloat16
    assert block.gate.weight.dtype == block.gate.e_score_correction_bias.dtype == torch.float32
    assert torch.equal(block.gate.weight, stored["model.layers.1.mlp.gate.weight"])
    assert torch.equal(
        block.gate.e_score_correction_bias, stored["model.layers.1.mlp.gate.e_score_correction_bias"]
    )

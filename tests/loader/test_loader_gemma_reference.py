"""The real Gemma 3 270M Q4_K_M GGUF against transformers' GGUF loader: same config, identical tensors."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import gguf
import pytest
import torch
from transformers import AutoModelForCausalLM

from edgeinfer.engine.model.loader import open_checkpoint

pytestmark = pytest.mark.gemma

SAME_KEYS = (
    *("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"),
    *("num_key_value_heads", "head_dim", "max_position_embeddings", "sliding_window", "layer_types"),
    *("query_pre_attn_scalar", "final_logit_softcapping", "attn_logit_softcapping", "attention_bias"),
    *("hidden_activation", "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id"),
)


@pytest.fixture(scope="module")
def reference(gemma_gguf: Path) -> dict[str, Any]:
    """transformers' config and state dict for the file, loaded once per module."""
    # transformers parses the file with gguf.GGUFReader twice (config, then tensors), ~10 s each for this
    # vocabulary; handing it the same read-only reader the second time changes nothing but the wait.
    readers: dict[str, gguf.GGUFReader] = {}
    original = gguf.GGUFReader

    def shared_reader(path: str, *args: Any, **kwargs: Any) -> gguf.GGUFReader:
        if str(path) not in readers:
            readers[str(path)] = original(path, *args, **kwargs)
        return readers[str(path)]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", shared_reader)
        model = AutoModelForCausalLM.from_pretrained(
            gemma_gguf.parent, gguf_file=gemma_gguf.name, dtype=torch.float32
        )
    assert len(readers) == 1
    return {"config": model.config.to_dict(), **model.state_dict()}


def test_config(gemma_gguf: Path, reference: dict[str, Any]) -> None:
    ours, theirs = open_checkpoint(gemma_gguf).config, reference["config"]
    assert ours["architectures"] == ["Gemma3ForCausalLM"] and ours["model_type"] == theirs["model_type"]
    for key in SAME_KEYS:
        assert ours[key] == theirs[key], key
    assert math.isclose(ours["rms_norm_eps"], theirs["rms_norm_eps"], rel_tol=1e-6)
    assert ours["rope_theta"] == theirs["rope_parameters"]["full_attention"]["rope_theta"] == 1e6
    assert ours["rope_local_base_freq"] == theirs["rope_parameters"]["sliding_attention"]["rope_theta"] == 1e4
    assert (
        ours["rope_scaling"] is None and theirs["rope_parameters"]["full_attention"]["rope_type"] == "default"
    )
    # The values in the published google/gemma-3-270m config.json.
    published = {"hidden_size": 640, "num_hidden_layers": 18, "head_dim": 256, "rms_norm_eps": 1e-6}
    assert {key: ours[key] for key in published} == published


def test_every_tensor(gemma_gguf: Path, reference: dict[str, Any]) -> None:
    ckpt = open_checkpoint(gemma_gguf)
    expected = set(reference) - {"config", "lm_head.weight"}  # tied: the head is the embedding
    seen = set()
    for name, tensor in ckpt.iter_tensors(torch.float32):
        assert torch.equal(tensor, reference[name]), name
        seen.add(name)
    assert seen == expected and len(seen) == 236
    types = set(ckpt.gguf_tensor_types().values())
    assert {"Q4_K", "Q6_K", "Q5_0", "Q8_0", "F32"} <= types  # the K-quant dequantizers are exercised too

"""How GGUF metadata becomes an HF config, and the files whose metadata or tensors we must refuse."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGUFWriter
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from edgeinfer.engine.model.loader import CheckpointError, open_checkpoint
from edgeinfer.engine.model.loader.gguf_arch import ARCHITECTURES
from edgeinfer.engine.model.loader.gguf_meta import ArchMetadata
from edgeinfer.engine.model.loader.gguf_rope import llama3_rope_scaling

GEMMA3 = {
    "gemma3.embedding_length": 640,
    "gemma3.attention.head_count": 4,
    "gemma3.attention.key_length": 256,
    "gemma3.block_count": 8,
    "gemma3.attention.sliding_window": 512,
}


def gemma3_config(**extra: Any) -> dict[str, Any]:
    meta = ArchMetadata(Path("m.gguf"), "gemma3", {**GEMMA3, **{f"gemma3.{k}": v for k, v in extra.items()}})
    return ARCHITECTURES["gemma3"].family_config(meta, {})


def test_gemma3_defaults_are_llama_cpp_s() -> None:
    config = gemma3_config()
    assert config["layer_types"] == ["sliding_attention"] * 5 + ["full_attention"] + ["sliding_attention"] * 2
    assert config["sliding_window_pattern"] == 6
    assert config["rope_local_base_freq"] == 10000.0
    assert config["rope_theta"] == 1000000.0
    assert config["query_pre_attn_scalar"] == 256  # head_dim, not hidden/heads = 160
    assert config["final_logit_softcapping"] is None and config["attn_logit_softcapping"] is None


def test_gemma3_sliding_pattern_from_metadata() -> None:
    period = gemma3_config(**{"attention.sliding_window_pattern": 4})
    assert period["layer_types"] == (["sliding_attention"] * 3 + ["full_attention"]) * 2
    flags = [True, False] * 4
    listed = gemma3_config(**{"attention.sliding_window_pattern": flags})
    assert listed["layer_types"] == ["sliding_attention", "full_attention"] * 4
    assert "sliding_window_pattern" not in listed
    with pytest.raises(CheckpointError, match="3 sliding-window flags for 8 layers"):
        gemma3_config(**{"attention.sliding_window_pattern": [True] * 3})


def test_gemma3_without_sliding_window_is_all_global() -> None:
    config = gemma3_config(**{"attention.sliding_window": 0})
    assert config["sliding_window"] is None
    assert set(config["layer_types"]) == {"full_attention"}


def test_gemma3_27b_query_scale_and_stored_overrides() -> None:
    sizes_27b = {
        "block_count": 62,
        "attention.head_count": 32,
        "embedding_length": 5376,
        "attention.key_length": 128,
    }
    big = ArchMetadata(
        Path("m.gguf"), "gemma3", {**GEMMA3, **{f"gemma3.{k}": v for k, v in sizes_27b.items()}}
    )
    assert ARCHITECTURES["gemma3"].family_config(big, {})["query_pre_attn_scalar"] == 168
    config = gemma3_config(**{"rope.freq_base_swa": 20000.0, "final_logit_softcapping": 30.0})
    assert config["rope_local_base_freq"] == 20000.0
    assert config["final_logit_softcapping"] == 30.0


def write_llama(
    path: Path, drop: str | None = None, arch: str = "llama", extra_tensor: str | None = None
) -> Path:
    """A minimal llama-shaped GGUF (metadata plus one tensor), optionally missing one metadata key."""
    writer = GGUFWriter(str(path), arch)
    keys = {
        "context_length": 128,
        "embedding_length": 32,
        "block_count": 1,
        "feed_forward_length": 64,
        "attention.head_count": 2,
        "attention.layer_norm_rms_epsilon": 1e-5,
    }
    for key, value in keys.items():
        if key != drop:
            adder = writer.add_float32 if isinstance(value, float) else writer.add_uint32
            adder(f"{arch}.{key}", value)
    writer.add_vocab_size(8)
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    if extra_tensor:
        writer.add_tensor(extra_tensor, np.ones(8, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_minimal_llama_opens(tmp_path: Path) -> None:
    ckpt = open_checkpoint(write_llama(tmp_path / "ok.gguf"))
    assert ckpt.config["architectures"] == ["LlamaForCausalLM"]
    assert ckpt.config["head_dim"] == 16 and ckpt.config["num_key_value_heads"] == 2
    assert ckpt.config["rope_theta"] == 10000.0 and ckpt.config["rope_scaling"] is None
    assert ckpt.config["tie_word_embeddings"] is True


def test_unsupported_architecture(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"m\.gguf: unsupported GGUF architecture 'mamba'"):
        open_checkpoint(write_llama(tmp_path / "m.gguf", arch="mamba"))


def test_missing_metadata_key(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"m\.gguf: GGUF metadata lacks llama\.embedding_length"):
        open_checkpoint(write_llama(tmp_path / "m.gguf", drop="embedding_length"))


def test_unknown_tensor_is_refused_not_skipped(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"tensor blk\.0\.attn_qkv\.weight has no known place"):
        open_checkpoint(write_llama(tmp_path / "m.gguf", extra_tensor="blk.0.attn_qkv.weight"))


def llama_cpp_rope_freqs(theta: float, head_dim: int, scaling: dict[str, Any]) -> np.ndarray:
    """The divisors llama.cpp's converter writes as rope_freqs for a Llama 3 rope_scaling."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    context = scaling["original_max_position_embeddings"]
    divisors = []
    for i in range(0, head_dim, 2):
        wavelength = 2 * math.pi * theta ** (i / head_dim)
        if wavelength < context / high:
            divisors.append(1.0)
        elif wavelength > context / low:
            divisors.append(factor)
        else:
            smooth = (context / wavelength - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(divisors, dtype=np.float32)


@pytest.mark.parametrize("factor", [8.0, 32.0])  # Llama 3.1 and Llama 3.2
def test_llama3_rope_scaling_recovered_from_rope_freqs(factor: float) -> None:
    scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}  # fmt: skip
    divisors = llama_cpp_rope_freqs(500000.0, 128, scaling)
    recovered = llama3_rope_scaling(divisors, 500000.0, 128, Path("m.gguf"))
    assert recovered == scaling
    # ...and transformers computes the same frequencies from it.
    config = LlamaConfig(
        hidden_size=4096, num_attention_heads=32, rope_theta=500000.0, rope_scaling=recovered
    )
    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    default = 500000.0 ** -(np.arange(0, 128, 2) / 128)
    np.testing.assert_allclose(inv_freq.numpy(), default / divisors, rtol=1e-6)


def test_rope_freqs_are_configuration_not_weights(tmp_path: Path) -> None:
    ckpt = open_checkpoint(write_llama(tmp_path / "m.gguf", extra_tensor="rope_freqs.weight"))  # all ones
    assert ckpt.config["rope_scaling"] is None
    assert ckpt.tensor_names() == ["model.embed_tokens.weight"]
    with pytest.raises(CheckpointError, match="too few smoothed entries"):
        llama3_rope_scaling(np.array([1, 1, 8, 8], dtype=np.float32), 10000.0, 8, tmp_path)

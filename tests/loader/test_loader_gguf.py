"""GGUF loading: config and every tensor against transformers' own GGUF loader and against the HF model the
file was written from, plus the metadata rules and the errors."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_gguf import write_gguf
from transformers import AutoModelForCausalLM

from edgeinfer.engine.model.loader import CheckpointError, open_checkpoint


@pytest.fixture(scope="module")
def transformers_model(gguf_path: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    )


def transformers_value(config: dict[str, Any], key: str) -> Any:
    """Where transformers v5 keeps what our (config.json-style) key holds."""
    rope = config.get("rope_parameters") or {}
    if key == "rope_theta":
        return rope.get("full_attention", rope).get("rope_theta")
    if key == "rope_local_base_freq":
        return rope["sliding_attention"]["rope_theta"]
    if key == "rope_scaling":
        return None if rope.get("full_attention", rope).get("rope_type") == "default" else "scaled"
    if key == "sliding_window_pattern":
        return config["_sliding_window_pattern"]
    return config.get(key, "<absent>")


def assert_same_value(key: str, ours: Any, theirs: Any) -> None:
    if isinstance(ours, float) and isinstance(theirs, float):
        # GGUF holds float32; we report the decimal it came from (1e-05), transformers the float32 itself.
        assert math.isclose(ours, theirs, rel_tol=1e-6), (key, ours, theirs)
    else:
        assert ours == theirs, (key, ours, theirs)


# transformers' GGUF loader leaves query_pre_attn_scalar at its class default (256) whatever the file says;
# llama.cpp scales by head_dim (hidden/heads for the 27B), which is what Google's configs hold and what we
# report (checked against the HF model below). They agree whenever head_dim is 256, as in Gemma 3 270M.
_TRANSFORMERS_DEFAULTS_ONLY = {"architectures", "query_pre_attn_scalar"}


def test_config_matches_transformers(gguf_path: Path, transformers_model: torch.nn.Module) -> None:
    ckpt = open_checkpoint(gguf_path)
    theirs = transformers_model.config.to_dict()
    assert ckpt.config["architectures"] == [type(transformers_model).__name__]
    for key, value in ckpt.config.items():
        if key not in _TRANSFORMERS_DEFAULTS_ONLY:
            assert_same_value(key, value, transformers_value(theirs, key))


def test_every_tensor_matches_transformers(gguf_path: Path, transformers_model: torch.nn.Module) -> None:
    ckpt = open_checkpoint(gguf_path)
    reference = transformers_model.state_dict()
    expected = set(reference) - ({"lm_head.weight"} if ckpt.config["tie_word_embeddings"] else set())
    ours = dict(ckpt.iter_tensors(torch.float32))
    assert set(ours) == expected == set(ckpt.tensor_names())
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, reference[name]), name


def test_unquantized_file_gives_back_the_hf_weights(
    tmp_path: Path, family: str, hf_model: torch.nn.Module
) -> None:
    ckpt = open_checkpoint(write_gguf(tmp_path / "f32.gguf", family, hf_model, quantized=False))
    original = hf_model.state_dict()
    for name, tensor in ckpt.iter_tensors(torch.float32):
        if family == "gemma3" and name.endswith("norm.weight"):
            # (w + 1) - 1 in float32 loses the bits of w below float32's resolution near 1.0.
            torch.testing.assert_close(tensor, original[name], rtol=0, atol=1e-6)
        else:
            assert torch.equal(tensor, original[name]), name


def test_config_describes_the_hf_model(gguf_path: Path, hf_model: torch.nn.Module) -> None:
    ours = open_checkpoint(gguf_path).config
    hf = hf_model.config
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "vocab_size", "max_position_embeddings", "tie_word_embeddings",
                "bos_token_id", "eos_token_id", "pad_token_id"):  # fmt: skip
        assert ours[key] == getattr(hf, key), key
    assert ours["rms_norm_eps"] == hf.rms_norm_eps  # exact: the float32 rounding is undone
    assert ours["head_dim"] == getattr(hf, "head_dim", hf.hidden_size // hf.num_attention_heads)
    if ours["model_type"] == "gemma3_text":
        assert ours["layer_types"] == hf.layer_types
        assert ours["sliding_window"] == hf.sliding_window
        assert ours["query_pre_attn_scalar"] == hf.query_pre_attn_scalar
        assert ours["rope_theta"] == hf.rope_parameters["full_attention"]["rope_theta"]
        assert ours["rope_local_base_freq"] == hf.rope_parameters["sliding_attention"]["rope_theta"]
    else:
        assert ours["rope_theta"] == hf.rope_parameters["rope_theta"]


def test_casts_to_the_requested_dtype(gguf_path: Path) -> None:
    ckpt = open_checkpoint(gguf_path)
    full = dict(ckpt.iter_tensors(torch.float32))
    for name, tensor in ckpt.iter_tensors(torch.bfloat16):
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, full[name].to(torch.bfloat16)), name


def test_reports_storage_types_and_paths(gguf_path: Path, family: str) -> None:
    ckpt = open_checkpoint(str(gguf_path))
    types = ckpt.gguf_tensor_types()
    assert types["model.embed_tokens.weight"] == "Q8_0"
    assert types["model.layers.0.self_attn.o_proj.weight"] == "BF16"
    assert types["model.norm.weight"] == "F32"
    assert ckpt.gguf_path == gguf_path and ckpt.format == "gguf"
    assert ckpt.tokenizer_dir == gguf_path.with_name(gguf_path.name + ".tokenizer")


@pytest.mark.parametrize("keep", [16, 200, 2000, -100])
def test_truncated_file_is_refused(tmp_path: Path, gguf_path: Path, keep: int) -> None:
    data = gguf_path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:keep])
    with pytest.raises(CheckpointError, match=r"cut\.gguf: truncated GGUF"):
        open_checkpoint(cut)


@pytest.mark.parametrize("past_key", [40, 1000])
def test_file_cut_inside_the_vocabulary_is_refused(tmp_path: Path, gguf_path: Path, past_key: int) -> None:
    """The token strings are walked past in one loop that checks its bounds once, at the end."""
    data = gguf_path.read_bytes()
    at = data.index(b"tokenizer.ggml.tokens") + past_key
    assert at < data.index(b"tokenizer.ggml.scores") or b"tokenizer.ggml.scores" not in data
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:at])
    with pytest.raises(CheckpointError, match=r"cut\.gguf: truncated GGUF"):
        open_checkpoint(cut)


def test_wrong_magic_and_version_are_refused(tmp_path: Path, gguf_path: Path) -> None:
    data = bytearray(gguf_path.read_bytes())
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + bytes(data[4:]))
    with pytest.raises(CheckpointError, match=r"bad\.gguf: not a GGUF file"):
        open_checkpoint(bad)
    data[4:8] = (1).to_bytes(4, "little")
    bad.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="unsupported GGUF version 1"):
        open_checkpoint(bad)


def test_corrupt_tensor_table_is_refused(tmp_path: Path, gguf_path: Path) -> None:
    data = gguf_path.read_bytes()
    name = b"output_norm.weight"
    at = data.index(name, data.index(b"tokenizer.ggml.pad")) + len(name)  # the tensor table entry
    corrupt = data[:at] + (9).to_bytes(4, "little") + data[at + 4 :]  # 9 dimensions
    path = tmp_path / "corrupt.gguf"
    path.write_bytes(corrupt)
    with pytest.raises(CheckpointError, match=r"corrupt\.gguf: corrupt GGUF tensor table"):
        open_checkpoint(path)

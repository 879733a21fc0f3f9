"""quantize -> save -> load: a tiny Llama written by `edgeinfer quantize` loads without its float weights
and gives the same logits as quantizing the float model at load; plus the compressed-tensors config and the
`edgeinfer compress` command."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from edgeinfer.cli import main
from edgeinfer.engine.attention.backend import get_attention_backend
from edgeinfer.engine.attention.metadata import AttentionMetadata
from edgeinfer.engine.attention.storage import KVCacheStorage
from edgeinfer.engine.model.loader import open_checkpoint
from edgeinfer.engine.model.loader.codec import open_compressed
from edgeinfer.engine.model.registry import build_model
from edgeinfer.engine.quant import (
    QuantizationConfig,
    QuantizationError,
    QuantLinear,
    apply_quantized_checkpoint,
    get_weight_method,
    load_quantized_linear_state,
    quantize_model,
)
from edgeinfer.engine.quant.packing import nibbles_to_int32, pack_nibbles

FUSED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
CASES = [("int8", []), ("fp8", []), ("int4", ["--group-size", "32"])]


def logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """One prefill of `ids` through the paged attention path."""
    n = len(ids)
    storage = KVCacheStorage(model.kv_spec, 8, 4, torch.float32, torch.device("cpu"))
    backend = get_attention_backend("torch", storage)
    blocks = list(range((n + 3) // 4))
    slots = torch.tensor([blocks[p // 4] * 4 + p % 4 for p in range(n)])
    backend.begin(AttentionMetadata(slots, [0], [n], [n], torch.tensor([blocks]), 0, 4))
    with torch.no_grad():
        return model.compute_logits(model(ids, torch.arange(n), backend))


def float_model(path: str) -> torch.nn.Module:
    ckpt = open_checkpoint(path)
    model = build_model(ckpt.config)
    model.load_weights(ckpt.iter_tensors(torch.float32))
    return model.eval()


def load_quantized(path: Path) -> torch.nn.Module:
    """What the engine's loader does for a quantized checkpoint: states in their stored dtypes (float8 and
    fp32 scales must not be cast to the serving dtype), quantized modules first, then the float rest."""
    config = json.loads((path / "config.json").read_text())
    qcfg = QuantizationConfig.from_hf(config)
    assert qcfg is not None
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    model = build_model(config)
    consumed = apply_quantized_checkpoint(model, tensors, qcfg, fused=FUSED)
    model.load_weights((n, t) for n, t in tensors.items() if n not in consumed)
    return model.eval()


@pytest.mark.parametrize(("method", "extra"), CASES)
def test_quantize_save_load_gives_identical_logits(method, extra, tiny_llama, tmp_path):
    out = tmp_path / method
    assert main(["quantize", tiny_llama, str(out), "--quantization", method, "--no-calibrate", *extra]) == 0
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    # the float weights are gone: loading cannot re-quantize, it can only use the stored state
    assert "model.layers.0.self_attn.q_proj.weight_scale" in names
    if method == "int4":
        assert "model.layers.0.self_attn.q_proj.weight" not in names
    assert "model.embed_tokens.weight" in names and "lm_head.weight" in names
    assert (out / "tokenizer.json").exists()

    loaded = load_quantized(out)
    options = {"group_size": 32} if method == "int4" else {}
    reference = quantize_model(float_model(tiny_llama), get_weight_method(method, **options))
    ids = torch.tensor([5, 17, 42, 99, 3, 250, 7, 8, 9])
    assert isinstance(loaded.model.layers[0].self_attn.qkv_proj, QuantLinear)
    assert torch.equal(logits(loaded, ids), logits(reference, ids))


@pytest.mark.parametrize(
    ("method", "extra", "spec", "gptq"),
    [
        ("int8", [], "int8:0", False),
        ("int4", ["--group-size", "32"], "int4:32", False),
        ("int4", ["--group-size", "32"], "int4:32", True),
    ],
)
def test_calibrated_quantize_equals_calibrating_at_load(method, extra, spec, gptq, tiny_models, tmp_path):
    """Offline and at load, the same scaling and int4 states (to nearest or by GPTQ; fused layers' states
    split into the checkpoint's parts): the written checkpoint serves the same logits (int8 unrotated, as
    compressed-tensors stores it; lm_head in float, as a tied checkpoint needs)."""
    from edgeinfer.engine.config import EngineConfig
    from edgeinfer.engine.loading import load_model
    from edgeinfer.engine.quant.calibrate import default_calibration_text

    src = tiny_models["gemma3"]  # Gemma's (1 + w) norms and a tied lm_head: the trickiest to write back
    out = tmp_path / method
    text = None
    if gptq:
        text = tmp_path / "calibration.txt"
        text.write_text(default_calibration_text() * 2)
        extra = [*extra, "--gptq", str(text)]
    assert main(["quantize", src, str(out), "--quantization", method, *extra]) == 0
    cpu = torch.device("cpu")
    offline = load_model(open_checkpoint(str(out)), torch.float32, cpu)
    cfg = EngineConfig(
        model=src,
        quantization=spec,
        lm_head_quantization="none",
        gptq_calibration=None if text is None else str(text),
    )
    at_load = load_model(open_checkpoint(src), torch.float32, cpu, cfg)
    plain = load_model(
        open_checkpoint(src),
        torch.float32,
        cpu,
        EngineConfig(model=src, quantization=spec, lm_head_quantization="none", calibrate_quantization=False),
    )
    ids = torch.tensor([5, 17, 42, 99, 3, 250, 7, 8, 9])
    got, want = logits(offline, ids), logits(at_load, ids)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(logits(plain, ids), want, atol=1e-4)  # calibration really changed the model
    if gptq:  # and GPTQ rounded differently from rounding to nearest after the same scaling
        rounded = load_model(open_checkpoint(src), torch.float32, cpu, replace(cfg, gptq_calibration=None))
        assert not torch.allclose(logits(rounded, ids), want, atol=1e-4)


def test_config_is_compressed_tensors(tiny_llama, tmp_path):
    out = tmp_path / "q"
    assert main(["quantize", tiny_llama, str(out), "-q", "int4", "--group-size", "64"]) == 0
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
    weights = qc["config_groups"]["group_0"]["weights"]
    assert (weights["num_bits"], weights["symmetric"], weights["group_size"]) == (4, False, 64)
    assert "lm_head" in qc["ignore"]
    parsed = QuantizationConfig.from_hf({"quantization_config": qc})
    assert parsed is not None and (parsed.method, parsed.group_size) == ("int4", 64)


def test_symmetric_int4_checkpoints_load_with_implied_zero_point():
    """GPTQ-style symmetric exports store no zero point: q in [-8, 7] means zp = 8 in our unsigned terms."""
    m = get_weight_method("int4", group_size=32)
    w = torch.randn(16, 64) * 0.1
    scale = (w.unflatten(-1, (2, 32)).abs().amax(-1) / 7).to(torch.bfloat16)
    q = torch.round(w.unflatten(-1, (2, 32)) / scale.float().unsqueeze(-1)).clamp(-8, 7) + 8
    state = m.pack({"q": q.flatten(-2).to(torch.uint8), "zero": torch.full((16, 2), 8), "scale": scale})
    tensors = {f"layer.{k}": v for k, v in state.items() if k != "weight_zero_point"}
    loaded = load_quantized_linear_state(tensors, "layer", m)
    assert loaded is not None
    w_hat = m.dequantize(loaded, torch.float32)
    assert torch.all((w - w_hat).abs() <= scale.float().repeat_interleave(32, -1) / 2 + 1e-7)


def pack_rows_int32(q: torch.Tensor) -> torch.Tensor:
    """4-bit values `[N, G]` packed along the rows, 8 to an int32 word (compressed-tensors zero points)."""
    pad = (-q.shape[0]) % 8
    q = torch.cat([q, q.new_zeros(pad, q.shape[1])])
    return nibbles_to_int32(pack_nibbles(q.t())).t().contiguous()


def test_integer_zero_point_checkpoints_load():
    """compressed-tensors' default int4 export: 4-bit integer zero points packed 8 rows to an int32."""
    m = get_weight_method("int4", group_size=32)
    g = torch.Generator().manual_seed(4)
    q = torch.randint(0, 16, (20, 64), generator=g, dtype=torch.uint8)
    zp = torch.randint(0, 16, (20, 2), generator=g, dtype=torch.uint8)
    scale = (torch.rand(20, 2, generator=g) * 0.01 + 1e-3).to(torch.bfloat16)
    state = m.pack({"q": q, "zero": zp, "scale": scale})
    state["weight_zero_point"] = pack_rows_int32(zp)  # [ceil(20 / 8), 2] int32
    loaded = load_quantized_linear_state({f"layer.{k}": v for k, v in state.items()}, "layer", m)
    assert loaded is not None
    want = (q.float().unflatten(-1, (2, 32)) - zp.float().unsqueeze(-1)) * scale.float().unsqueeze(-1)
    assert torch.equal(m.dequantize(loaded, torch.float32), want.flatten(-2))
    state["weight_zero_point"] = zp  # unpacked integers, one per group, as some exporters write them
    loaded = load_quantized_linear_state({f"layer.{k}": v for k, v in state.items()}, "layer", m)
    assert loaded is not None and torch.equal(m.dequantize(loaded, torch.float32), want.flatten(-2))


def test_partial_or_foreign_states_are_refused():
    m = get_weight_method("int8")
    assert load_quantized_linear_state({"a.weight": torch.randn(4, 4)}, "a", m) is None
    with pytest.raises(QuantizationError, match="a: int8 state lacks weight"):
        load_quantized_linear_state({"a.weight_scale": torch.ones(4, 1)}, "a", m)
    with pytest.raises(QuantizationError, match="unsupported quant_method 'awq'"):
        QuantizationConfig.from_hf({"quantization_config": {"quant_method": "awq"}})


def test_compress_command_round_trips_a_bf16_checkpoint(tiny_llama, tmp_path):
    src = tmp_path / "bf16"
    src.mkdir()
    ckpt = open_checkpoint(tiny_llama)
    tensors = dict(ckpt.iter_tensors(torch.bfloat16))
    from safetensors.torch import save_file

    save_file(tensors, str(src / "model.safetensors"))
    for f in Path(tiny_llama).iterdir():
        if f.suffix != ".safetensors":
            (src / f.name).write_bytes(f.read_bytes())
    out = tmp_path / "eiz"
    assert main(["compress", str(src), str(out)]) == 0
    assert (out / "config.json").exists() and (out / "tokenizer.json").exists()
    decoded = dict(open_compressed(out))
    assert decoded.keys() == tensors.keys()
    assert all(torch.equal(decoded[k].view(torch.int16), tensors[k].view(torch.int16)) for k in tensors)
    assert main(["compress", str(src), str(out)]) == 2  # refuses to overwrite

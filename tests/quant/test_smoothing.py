"""Activation-aware input scaling: the float function is preserved, quantization error falls where input
channels are uneven, channels a norm zeroes stay finite, and engines load with it on and off."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from torch import nn

from edgeinfer.engine.attention.oneshot import prefill_hidden
from edgeinfer.engine.config import EngineConfig
from edgeinfer.engine.loading import load_model
from edgeinfer.engine.model.loader import open_checkpoint
from edgeinfer.engine.quant import get_weight_method
from edgeinfer.engine.quant.calibrate import InputSample, calibration_windows, collect_inputs
from edgeinfer.engine.quant.smoothing import (
    ScaledEmbedding,
    _quantized_matmul,
    scale_for_quantization,
    search_scale,
    smooth_model,
    smoothing_groups,
)


def uneven_inputs(rows: int, seed: int) -> torch.Tensor:
    """Activations whose channel magnitudes span 3 orders (the same channels for every seed), as after
    a norm with uneven weights; `seed` draws new rows."""
    channel = torch.logspace(-1.5, 1.5, 256)[torch.randperm(256, generator=torch.Generator().manual_seed(0))]
    return torch.randn(rows, 256, generator=torch.Generator().manual_seed(seed)) * channel


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_search_cuts_quantization_error_on_held_out_rows(method):
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(1)) * 0.05
    calib, held_out = uneven_inputs(256, 10), uneven_inputs(256, 11)
    sample = InputSample(calib.abs().mean(0), calib.square().mean(0), calib)
    m = get_weight_method(method)
    label, c, err0, err = search_scale(sample, [w], m, torch.float32)
    assert label != "mean^0" and err < err0
    ref = held_out @ w.t()
    plain = (_quantized_matmul(m, w, held_out) - ref).square().sum()
    scaled = (_quantized_matmul(m, w * c, held_out / c) - ref).square().sum()
    assert scaled < 0.7 * plain  # measured: int8 and int4 both at least 1.7x lower


def _tokens(n: int, vocab: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_scaling_keeps_the_float_model(tiny_models, family):
    ckpt = open_checkpoint(tiny_models[family])
    model = load_model(ckpt, torch.float32, torch.device("cpu"))
    if family == "gemma3":  # a channel the pre-MLP norm zeroes: its scale must stay finite
        model.model.layers[0].pre_feedforward_layernorm.weight.data[3] = -1.0
    probe = [calibration_windows(_tokens(40, model.args.vocab_size, 1), None)[0]]
    names = {n for g in smoothing_groups(model) for n, _ in g.linears}
    before = collect_inputs(model, probe, names, partial(_hidden, model))
    ref = model.compute_logits(_hidden(model, probe[0]))
    calib = calibration_windows(_tokens(96, model.args.vocab_size), None)
    samples = collect_inputs(model, calib, names, partial(_hidden, model))
    report = smooth_model(model, get_weight_method("int8"), samples)
    assert len(report.chosen) == 3 * model.args.num_layers + 1  # + the lm_head
    if model.args.tie_embeddings and report.chosen["lm_head"][0] != "mean^0":
        # still tied: the embedding looks up the scaled lm_head weight itself
        assert isinstance(model.model.embed_tokens, ScaledEmbedding)
        assert model.model.embed_tokens.inner.weight is model.lm_head.weight
    assert any(label != "mean^0" for label, _, _ in report.chosen.values())
    assert all(err <= err0 for _, err0, err in report.chosen.values())
    assert all(torch.isfinite(p).all() for p in model.parameters())
    out = model.compute_logits(_hidden(model, probe[0]))
    torch.testing.assert_close(out, ref, atol=2e-4, rtol=2e-4)
    # the scaled inputs really differ: the scale moved into the producer
    after = collect_inputs(model, probe, names, partial(_hidden, model))
    assert any(not torch.allclose(before[n].abs_mean, after[n].abs_mean) for n in names)


def _hidden(model: nn.Module, ids: list[int]) -> torch.Tensor:
    return prefill_hidden(model, ids, torch.float32, torch.device("cpu"))


def test_calibrated_bf16_model_keeps_its_dtype_and_stays_close(tiny_llama):
    """Scaled layers pass through fp32 on their way to the quantizer; nothing fp32 may be left behind."""
    ckpt = open_checkpoint(tiny_llama)
    cpu = torch.device("cpu")
    ids = _tokens(48, 100)
    ref = load_model(ckpt, torch.float32, cpu)
    want = torch.log_softmax(ref.compute_logits(_hidden(ref, ids)), -1)
    cfg = EngineConfig(model=tiny_llama, quantization="int8", dtype="bfloat16")
    m = load_model(ckpt, torch.bfloat16, cpu, cfg)
    assert {p.dtype for p in m.parameters()} == {torch.bfloat16}
    got = torch.log_softmax(m.compute_logits(prefill_hidden(m, ids, torch.bfloat16, cpu)), -1)
    kl = (want.exp() * (want - got)).sum(-1)
    assert kl.mean() < 0.01


def test_skipped_layers_stay_in_the_model_dtype(tiny_llama):
    """Skipping `gate_up_proj` also skips `down_proj`'s scaling, whose fold would edit gate_up's rows."""
    ckpt = open_checkpoint(tiny_llama)
    model = load_model(ckpt, torch.bfloat16, torch.device("cpu"))
    skip = lambda name: name.endswith("gate_up_proj")  # noqa: E731
    report = scale_for_quantization(
        model,
        get_weight_method("int8"),
        _tokens(64, 100),
        None,
        partial(prefill_hidden, model, dtype=torch.bfloat16, device=torch.device("cpu")),
        skip,
    )
    assert report.chosen and not any("mlp" in name for name in report.chosen)
    for layer in model.model.layers:
        assert layer.mlp.gate_up_proj.weight.dtype == torch.bfloat16

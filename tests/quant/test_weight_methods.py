"""Weight methods: round-trip error bounds, QuantLinear vs nn.Linear bounds, kernels actually used.

Bounds (s = the scale a value was quantized with):
- int8: |w - w^| <= s/2, s = amax(row)/127 (round to nearest on a uniform grid).
- int4: |w - w^| <= S (1 + 1/8), S = (max(row group, 0) - min(row group, 0))/15, the step of the group's
  min/max grid: the least-squares fit may trade one weight's error for the group's, but never beyond one
  such step (int4.py), and the bf16 scale and zero point add under S/8; the CPU kernel's bf16 zero term
  adds at most s/64.
- fp8 e4m3: |w - w^| <= max(|w| 2^-4, s 2^-10), s = amax(row)/448 (3 mantissa bits; subnormal spacing 2^-9 s).
A linear layer then errs by at most sum_k |x_k| |dw_k| (+ |w^_k| |dx_k| for int8's quantized activations).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from edgeinfer.engine.quant import (
    QuantizationError,
    QuantLinear,
    get_weight_method,
    quantize_expert_weights,
    quantize_model,
)
from edgeinfer.engine.quant.int8 import quantize_rows_int8
from edgeinfer.engine.quant.packing import fp8_to_bf16

METHODS = ["int8", "int4", "fp8"]


def make_weight(out: int = 48, inp: int = 256, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inp, generator=g) * 0.05
    w[0] = 0.0  # an all-zero row
    w[1, 7] = 3.0  # an outlier
    w[2] = w[2].abs() + 0.01  # an all-positive row (int4's range must still include 0)
    return w


def weight_bound(method: str, w: torch.Tensor, group: int = 128) -> torch.Tensor:
    if method == "int8":
        return (w.abs().amax(-1, keepdim=True) / 127 / 2).expand_as(w)
    if method == "fp8":
        s = w.abs().amax(-1, keepdim=True) / 448
        return torch.maximum(w.abs() * 2**-4, s * 2**-10)
    groups = w.unflatten(-1, (-1, group))
    step = (groups.amax(-1).clamp(min=0) - groups.amin(-1).clamp(max=0)) / 15
    return (step.unsqueeze(-1) * (1 + 1 / 8)).expand_as(groups).flatten(-2)


@pytest.mark.parametrize("method", METHODS)
def test_round_trip_within_bound(method):
    w = make_weight()
    m = get_weight_method(method)
    w_hat = m.dequantize(m.quantize(w), torch.float32)
    assert torch.all((w - w_hat).abs() <= weight_bound(method, w) * (1 + 1e-5) + 1e-12)
    assert torch.all(w_hat[0] == 0)


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_group_sizes_and_packing(group):
    w = make_weight(inp=256)
    m = get_weight_method("int4", group_size=group)
    state = m.quantize(w)
    assert state["weight_packed"].dtype == torch.int32 and state["weight_packed"].shape == (48, 256 // 8)
    assert state["weight_scale"].shape == (48, 256 // group)
    zero = state["weight_zero_point"]
    assert zero.dtype == torch.bfloat16 and zero.shape == (48, 256 // group)
    assert torch.all((zero >= 0) & (zero <= 15))
    assert state["weight_shape"].tolist() == [48, 256]
    w_hat = m.dequantize(state, torch.float32)
    assert torch.all((w - w_hat).abs() <= weight_bound("int4", w, group) * (1 + 1e-5))


def test_int4_layout_matches_compressed_tensors_convention():
    """Signed q in [-8, 7] is stored as q + 8, value i of a word at bits 4i; dequant is (q - zp) * scale."""
    m = get_weight_method("int4", group_size=32)
    state = m.quantize(make_weight(out=16, inp=64))
    u = m.unpack(state)
    word = int(state["weight_packed"][3, 2]) & 0xFFFFFFFF
    assert [(word >> (4 * i)) & 15 for i in range(8)] == u["q"][3, 16:24].tolist()
    zp, scale = u["zero"].float().unsqueeze(-1), u["scale"].float().unsqueeze(-1)
    want = ((u["q"].float().unflatten(-1, (2, 32)) - zp) * scale).flatten(-2)
    assert torch.equal(m.dequantize(state, torch.float32), want)
    assert m.scheme()["weights"]["zp_dtype"] == "bfloat16"


def _minmax_error(w: torch.Tensor, group: int) -> torch.Tensor:
    """Error of rounding to the group's min/max grid with an integer zero point (the int4 before the fit)."""
    g = w.unflatten(-1, (-1, group))
    lo, hi = g.amin(-1, keepdim=True).clamp(max=0), g.amax(-1, keepdim=True).clamp(min=0)
    s = (hi - lo) / 15
    zp = torch.round(-lo / s)
    q = (torch.round(g / s) + zp).clamp(0, 15)
    return (g - (q - zp) * s).flatten(-2)


def test_int4_fit_lowers_the_error_and_follows_the_importance():
    """The least-squares grid beats the min/max grid on heavy-tailed weights, and given input energies
    it moves error from the busy inputs to the quiet ones."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(256, 512, generator=g).pow(3) * 0.01  # heavy tails, as trained weights have
    m = get_weight_method("int4", group_size=32)
    plain = w - m.dequantize(m.quantize(w), torch.float32)
    assert plain.square().mean() < 0.95 * _minmax_error(w, 32).square().mean()
    energy = torch.ones(512)
    energy[::4] = 100.0  # every fourth input carries most of the energy
    weighted = w - m.dequantize(m.quantize(w, energy), torch.float32)
    busy, quiet = weighted[:, ::4].square().mean(), weighted[:, 1::4].square().mean()
    assert busy < 0.8 * plain[:, ::4].square().mean() and quiet > plain[:, 1::4].square().mean()
    assert (weighted.square() * energy).sum() < (plain.square() * energy).sum()


def test_fp8_widening_is_exact_for_every_code():
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]  # the two NaN codes
    values = codes.view(torch.float8_e4m3fn)
    assert torch.equal(fp8_to_bf16(values), values.float().to(torch.bfloat16))
    e5 = torch.arange(256, dtype=torch.uint8)
    e5 = e5[(e5 & 0x7C) != 0x7C].view(torch.float8_e5m2)  # drop inf/nan codes
    assert torch.equal(fp8_to_bf16(e5), e5.float().to(torch.bfloat16))


def linear_bound(method: str, x: torch.Tensor, w: torch.Tensor, w_hat: torch.Tensor) -> torch.Tensor:
    """Worst-case |x w^T - layer(x)| per output, before output rounding."""
    dw = weight_bound(method, w)
    if method == "int4":
        dw = dw * (1 + 1 / 16)  # kernel's bf16 zero term: at most s/64
    bound = x.abs() @ dw.t()
    if method == "int8":
        _, sx = quantize_rows_int8(x)
        bound = bound + (sx / 2) * w_hat.abs().sum(-1)
    return bound + 1e-5 * (x.abs() @ w.abs().t())  # fp32 accumulation


@pytest.mark.parametrize("method", METHODS)
def test_quant_linear_matches_float_linear_within_bound(method):
    w, b = make_weight(), torch.randn(48)
    x = torch.randn(2, 9, 256)
    layer = QuantLinear.from_float(w, b, method)
    m = get_weight_method(method)
    w_hat = m.dequantize(m.quantize(w), torch.float32)
    err = (layer(x) - F.linear(x, w, b)).abs().reshape(-1, 48)
    assert torch.all(err <= linear_bound(method, x.reshape(-1, 256), w, w_hat))


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_wide_layers_take_the_blocked_paths_within_bound(method):
    """An lm_head-like 20000-row layer is processed in column (int8) or row (fp8) blocks."""
    g = torch.Generator().manual_seed(3)
    w, x = torch.randn(20000, 64, generator=g) * 0.05, torch.randn(40, 64, generator=g)
    m = get_weight_method(method)
    w_hat = m.dequantize(m.quantize(w), torch.float32)
    err = (QuantLinear.from_float(w, None, method)(x) - x @ w.t()).abs()
    assert torch.all(err <= linear_bound(method, x, w, w_hat))


@pytest.mark.parametrize("method", METHODS)
def test_bf16_activations(method):
    w = make_weight()
    x = torch.randn(5, 256).to(torch.bfloat16)
    layer = QuantLinear.from_float(w, None, method)
    y = layer(x)
    assert y.dtype == torch.bfloat16
    m = get_weight_method(method)
    w_hat = m.dequantize(m.quantize(w), torch.float32)
    ref = F.linear(x.float(), w)
    # plus bf16 rounding of the output and of intermediates
    bound = linear_bound(method, x.float(), w, w_hat) + ref.abs() * 2**-7
    assert torch.all((y.float() - ref).abs() <= bound)


def ops_called(fn) -> set[str]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return {e.name for e in prof.events()}


@pytest.mark.parametrize("tokens", [1, 8, 33])
def test_int8_uses_int_mm(tokens):
    layer = QuantLinear.from_float(make_weight(), None, "int8")
    assert layer.kernel_for(tokens) == "int_mm"
    assert "aten::_int_mm" in ops_called(lambda: layer(torch.randn(tokens, 256, dtype=torch.bfloat16)))


def test_int4_uses_fused_cpu_kernel_and_falls_back_for_odd_shapes():
    layer = QuantLinear.from_float(make_weight(), None, "int4")
    assert layer.kernel == "cpu_int4pack"
    assert "aten::_weight_int4pack_mm_for_cpu" in ops_called(lambda: layer(torch.randn(3, 256)))
    odd = make_weight(out=40)  # the fused kernel needs out_features % 16 == 0
    fallback = QuantLinear.from_float(odd, None, "int4")
    assert fallback.kernel == "dequant"
    m = get_weight_method("int4")
    x = torch.randn(3, 256)
    assert torch.allclose(fallback(x), F.linear(x, m.dequantize(m.quantize(odd), torch.float32)), atol=1e-5)


def test_quantize_model_replaces_linears_and_keeps_lm_head():
    model = torch.nn.Sequential()
    model.add_module("proj", torch.nn.Linear(256, 64))
    model.add_module("skipme", torch.nn.Linear(64, 64))
    model.add_module("lm_head", torch.nn.Linear(64, 100, bias=False))
    quantize_model(model, "int8", skip=["skip*"])
    assert isinstance(model.proj, QuantLinear)
    assert type(model.skipme) is torch.nn.Linear
    assert type(model.lm_head) is torch.nn.Linear
    assert model.proj.bias is not None and "bias" not in dict(model.proj.named_parameters())


class ToyExperts(torch.nn.Module):
    """Fused experts the way the MoE layer stores them, joining `quantize_model` through its hook."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.stack([make_weight(seed=i) for i in range(3)]))

    def quantize_weights(self, method) -> None:
        self.experts = quantize_expert_weights(self.w.data, method)
        del self.w


def test_quantize_model_calls_the_expert_hook():
    model = torch.nn.ModuleDict({"moe": ToyExperts(), "proj": torch.nn.Linear(256, 16)})
    quantize_model(model, "int4")
    assert model["moe"].experts.num_experts == 3 and not list(model["moe"].parameters())
    assert isinstance(model["proj"], QuantLinear)


def test_tied_embedding_and_lm_head_share_storage():
    emb = torch.nn.Embedding(100, 64)
    head = torch.nn.Linear(64, 100, bias=False)
    head.weight = emb.weight
    model = torch.nn.ModuleDict({"embed_tokens": emb, "lm_head": head})
    quantize_model(model, "int8", quantize_lm_head=True, quantize_embeddings=True)
    assert model["lm_head"].weight.data_ptr() == model["embed_tokens"].weight.data_ptr()
    ids = torch.tensor([[3, 99], [0, 42]])
    rows = model["embed_tokens"](ids)
    assert rows.shape == (2, 2, 64)
    assert torch.all((rows - emb.weight[ids]).abs() <= weight_bound("int8", emb.weight.detach())[ids] + 1e-7)


@pytest.mark.parametrize("method", METHODS)
def test_quantized_embedding_rows(method):
    w = make_weight(out=32, inp=128)
    m = get_weight_method(method, **({"group_size": 32} if method == "int4" else {}))
    state = m.quantize(w)
    ids = torch.tensor([0, 31, 5, 5, 17])
    assert torch.equal(m.embedding_rows(state, ids, torch.float32), m.dequantize(state, torch.float32)[ids])


@pytest.mark.parametrize("method", METHODS)
def test_experts_match_per_expert_layers(method):
    w3d = torch.stack([make_weight(seed=i) for i in range(4)])
    experts = quantize_expert_weights(w3d, method)
    x = torch.randn(6, 256, dtype=torch.bfloat16)
    ids = torch.tensor([3, 0, 3, 1, 1, 0])
    out = experts.grouped_linear(x, ids)
    for i, e in enumerate(ids.tolist()):
        single = QuantLinear.from_float(w3d[e], None, method)
        assert torch.equal(out[i], single(x[i : i + 1])[0])
    assert experts.dequantize(2, torch.float32).shape == (48, 256)
    with pytest.raises(QuantizationError, match="expert index 4"):
        experts.linear(x, 4)


@pytest.mark.parametrize("method", METHODS)
def test_fused_quantization_equals_concatenated_parts(method):
    """Row-wise quantization: quantizing [q; k; v] equals concatenating quantized q, k, v."""
    m = get_weight_method(method)
    parts = [make_weight(out=16, seed=s) for s in range(3)]
    fused = m.quantize(torch.cat(parts))
    joined = m.concat([m.quantize(p) for p in parts])
    assert all(torch.equal(fused[k], joined[k]) for k in fused)


def test_bad_inputs_are_refused_with_clear_errors():
    with pytest.raises(QuantizationError, match="unknown quantization method 'int3'"):
        get_weight_method("int3")
    with pytest.raises(QuantizationError, match="group_size must be one of"):
        get_weight_method("int4", group_size=48)
    with pytest.raises(QuantizationError, match="not a multiple of group_size"):
        get_weight_method("int4").quantize(torch.randn(16, 80))
    layer = QuantLinear.from_float(make_weight(), None, "int8")
    with pytest.raises(QuantizationError, match="expects 256"):
        layer(torch.randn(2, 255))

"""int8 with Hadamard-rotated inputs: the rotation is exact in float, every path (matmul, dequantize,
embedding rows, fallback) undoes it consistently, and it helps where one input channel is an outlier."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from edgeinfer.engine.loading import parse_quantization
from edgeinfer.engine.quant import QuantizationError, QuantLinear, get_weight_method
from edgeinfer.engine.quant.base import PreparedWeight


def _weight(out: int = 96, inp: int = 256) -> torch.Tensor:
    return torch.randn(out, inp, generator=torch.Generator().manual_seed(0)) * 0.05


def test_rotation_is_its_own_inverse_and_orthogonal():
    m = get_weight_method("int8", hadamard=64)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(m.rotate(m.rotate(x)), x, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(m.rotate(x).norm(dim=-1), x.norm(dim=-1), atol=1e-4, rtol=1e-5)


def test_block_follows_the_input_width():
    m = get_weight_method("int8", hadamard=128)
    assert [m.rotation_block(k) for k in (640, 1024, 64, 96, 24, 7)] == [128, 128, 64, 32, 0, 0]
    with pytest.raises(QuantizationError, match="power of two"):
        get_weight_method("int8", hadamard=100)


def test_parse_quantization_defaults_to_rotated_int8():
    assert parse_quantization("int8").options() == {"hadamard": 128}
    assert parse_quantization("int8:0").options() == {}
    assert parse_quantization("int4:32").options() == {"group_size": 32}
    with pytest.raises(ValueError, match="takes no"):
        parse_quantization("fp8:3")


def test_every_path_agrees_with_the_float_layer():
    w, m = _weight(), get_weight_method("int8", hadamard=128)
    x = torch.randn(7, 256, generator=torch.Generator().manual_seed(2))
    ref = F.linear(x, w)
    state = m.quantize(w)
    w_hat = m.dequantize(state, torch.float32)
    # rotation preserves each row's 2-norm, so the per-row error is at most sqrt(K) half-steps of W @ H
    step = m.rotate(w).abs().amax(-1) / 127
    assert bool(((w_hat - w).norm(dim=-1) <= step * 256**0.5 / 2 + 1e-7).all())
    layer = QuantLinear.from_float(w, method=m)
    got = layer(x)
    assert (got - ref).abs().max() < 0.02 * ref.abs().max()
    # the weight-only fallback (CUDA small M) must rotate the same way
    prepared = layer.prepared()
    fallback = PreparedWeight("dequant", prepared.tensors, prepared.out_features, prepared.in_features)
    m_fallback = get_weight_method("int8", hadamard=128)
    m_fallback.kernel_for = lambda weight, n: "dequant"
    torch.testing.assert_close(m_fallback.apply(fallback, x), x @ w_hat.t(), atol=1e-4, rtol=1e-4)
    # a tied embedding reads the same state: its rows come back un-rotated
    ids = torch.tensor([0, 5, 95])
    torch.testing.assert_close(m.embedding_rows(state, ids, torch.float32), w_hat[ids], atol=1e-6, rtol=1e-6)


def test_rotation_tames_an_outlier_input_channel():
    w = _weight()
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(3))
    x[:, 17] *= 60  # one massive channel, as in Gemma's activations
    ref = F.linear(x, w)
    errors = {}
    for block in (0, 128):
        layer = QuantLinear.from_float(w, method=get_weight_method("int8", hadamard=block))
        errors[block] = (layer(x) - ref).square().mean().item()
    assert errors[128] < errors[0] / 4

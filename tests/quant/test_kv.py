"""KV-cache quantizers: error bounds, pool layout, sizes, determinism (prefix caching), bad input.

Bounds per token and head (a = amax over head_dim, or over the group of 32 for int4):
- int8: a/254 (half a step of a/127), plus two bf16 roundings (2^-8 relative each) when dequantized to bf16;
- int4: a/14 (half a step of a/7; the bf16 scale may round down, values then clamp by < 2^-8 a);
- fp8 e4m3 / e5m2: 2^-4 / 2^-3 relative in the normal range, half the subnormal spacing below it;
- bf16: bf16 rounding; auto (fp32 model): exact.
"""

from __future__ import annotations

import pytest
import torch

from edgeinfer.engine.quant import KV_CACHE_DTYPES, QuantizationError, get_kv_quantizer

SHAPES = [(7, 2, 64), (5, 1, 576)]  # GQA heads, and an MLA latent [T, 1, kv_lora_rank + rope_dim]


def make_kv(t: int, h: int, d: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, d, generator=g)
    x = x * torch.logspace(-3, 2, t).view(t, 1, 1)  # tokens of very different magnitude
    x[0, 0] = 0.0  # an all-zero head
    x[-1, -1, 3] = 50 * x[-1, -1].abs().max()  # an outlier
    return x


def error_bound(name: str, x: torch.Tensor) -> torch.Tensor:
    a = x.abs().amax(-1, keepdim=True)
    if name == "int8":
        return a / 254 * (1 + 1e-6)
    if name == "int4":
        ga = x.unflatten(-1, (-1, 32)).abs().amax(-1, keepdim=True)
        return (ga / 14 * (1 + 2**-7)).expand(*ga.shape[:-1], 32).flatten(-2)
    if name.startswith("fp8"):
        rel, fmax, sub = (2**-4, 448.0, 2**-10) if name == "fp8_e4m3" else (2**-3, 57344.0, 2**-17)
        return torch.maximum(x.abs() * rel, a / fmax * sub) * (1 + 1e-6)
    if name == "bf16":
        return x.abs() * 2**-8
    return torch.zeros_like(x)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", KV_CACHE_DTYPES)
def test_round_trip_within_bound(name, shape):
    q = get_kv_quantizer(name, compute_dtype=torch.float32)
    x = make_kv(*shape)
    payload, scales = q.quantize(x)
    t, h, d = shape
    assert payload.dtype == q.storage_dtype and payload.shape == (t, h, q.payload_dim(d))
    assert scales.dtype == q.scale_dtype and scales.shape == (t, *q.scale_shape(h, d))
    x_hat = q.dequantize(payload, scales, torch.float32)
    assert torch.all((x - x_hat).abs() <= error_bound(name, x))
    assert torch.all(x_hat[0, 0] == 0)


@pytest.mark.parametrize("name", ["int8", "int4", "fp8_e4m3"])
def test_dequantize_to_bf16(name):
    q = get_kv_quantizer(name)
    x = make_kv(4, 2, 64)
    x_hat = q.dequantize(*q.quantize(x), torch.bfloat16)
    assert x_hat.dtype == torch.bfloat16
    # bf16 rounding of the scale and of the product: at most 2^-8 each, relative
    assert torch.all((x - x_hat.float()).abs() <= error_bound(name, x) * (1 + 2**-7) + x.abs() * 2**-7)


@pytest.mark.parametrize("name", KV_CACHE_DTYPES)
def test_pool_write_and_read_by_slot(name):
    q = get_kv_quantizer(name)
    payload_pool, scale_pool = q.allocate(num_blocks=4, block_size=4, num_heads=2, head_dim=64)
    assert payload_pool.shape == (4, 4, 2, q.payload_dim(64))
    assert scale_pool.shape == (4, 4, *q.scale_shape(2, 64))
    x = make_kv(3, 2, 64).to(torch.bfloat16)
    slots = torch.tensor([13, 2, 7])
    q.write(payload_pool, scale_pool, slots, x)
    got = q.read(payload_pool, scale_pool, torch.tensor([[2, 13], [7, 7]]), torch.bfloat16)
    direct = q.dequantize(*q.quantize(x), torch.bfloat16)
    assert got.shape == (2, 2, 2, 64)
    assert torch.equal(got[0, 0], direct[1]) and torch.equal(got[0, 1], direct[0])
    assert torch.equal(got[1, 0], direct[2])
    blocks = q.gather_blocks(payload_pool, scale_pool, torch.tensor([[3, 0], [1, 1]]), torch.bfloat16)
    assert blocks.shape == (2, 8, 2, 64)
    assert torch.equal(blocks[0, 1], direct[0]) and torch.equal(blocks[0, 4 + 2], direct[1])
    assert torch.equal(blocks[1, 3], direct[2]) and torch.equal(blocks[1, 7], direct[2])


@pytest.mark.parametrize("name", KV_CACHE_DTYPES)
def test_each_token_quantizes_alone(name):
    """A token's stored bytes do not depend on its batch neighbours, so equal prefixes give equal blocks."""
    q = get_kv_quantizer(name)
    x = make_kv(6, 2, 64)
    batch = q.quantize(x)
    for i in range(6):
        alone = q.quantize(x[i : i + 1])
        assert torch.equal(alone[0].view(torch.uint8), batch[0][i : i + 1].view(torch.uint8))
        assert torch.equal(alone[1], batch[1][i : i + 1])


def test_bytes_per_token_meet_capacity_targets():
    """Gemma 3 270M has 1 KV head of 256: int8 must fit >= 1.9x, int4 >= 3.5x the tokens of bf16."""
    base = get_kv_quantizer("bf16").bytes_per_token(1, 256)
    assert base == 512
    assert base / get_kv_quantizer("int8").bytes_per_token(1, 256) >= 1.9
    assert base / get_kv_quantizer("fp8_e4m3").bytes_per_token(1, 256) >= 1.9
    assert base / get_kv_quantizer("int4").bytes_per_token(1, 256) >= 3.5
    assert get_kv_quantizer("int4").bytes_per_value == 0.5
    assert get_kv_quantizer("auto", torch.float32).bytes_per_token(2, 64) == 2 * 64 * 4


@pytest.mark.parametrize("name", ["int8", "int4", "fp8_e4m3", "fp8_e5m2"])
def test_nan_is_not_hidden(name):
    """A NaN in K/V must reach attention as NaN (the engine then fails that request), not a finite value."""
    q = get_kv_quantizer(name)
    x = make_kv(2, 1, 64)
    x[1, 0, 5] = float("nan")
    x_hat = q.dequantize(*q.quantize(x), torch.float32)
    assert torch.isnan(x_hat[1, 0, 5]) and not torch.isnan(x_hat[0]).any()


def test_bad_input():
    with pytest.raises(QuantizationError, match="unknown kv_cache_dtype 'fp4'"):
        get_kv_quantizer("fp4")
    with pytest.raises(QuantizationError, match="divisible by 32"):
        get_kv_quantizer("int4").scale_shape(2, 48)
    with pytest.raises(QuantizationError, match=r"\[tokens, heads, head_dim\]"):
        get_kv_quantizer("int8").quantize(torch.randn(4, 64))

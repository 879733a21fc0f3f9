"""The packed encoder attention kernel (kernels/encoder_attention.cpp) against SDPA run per
sequence, at each instruction-set level this CPU runs, and its refusals of malformed inputs."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from edgeinfer.engine import kernels


def _reference(qkv: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """fp32 SDPA of each sequence alone: [T, H, D]."""
    outs, start = [], 0
    for n in lengths:
        q, k, v = qkv[start : start + n].float().permute(1, 2, 0, 3)  # each [H, n, D]
        outs.append(F.scaled_dot_product_attention(q, k, v).transpose(0, 1))
        start += n
    return torch.cat(outs)


def _qkv(lengths: list[int], heads: int, dim: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(sum(lengths), 3, heads, dim, generator=g) * 2).to(dtype)


@pytest.mark.parametrize("dim", [16, 32, 48, 64, 128])  # 48: no vector variant, plain loops
@pytest.mark.parametrize("lengths", [[1], [5, 5, 33], [1, 2, 3, 4, 31, 32, 64, 65, 100]], ids=str)
def test_fp32_matches_sdpa(ops, level, dim, lengths):
    qkv = _qkv(lengths, 3, dim, torch.float32, seed=dim + len(lengths))
    cu = torch.tensor([0, *itertools.accumulate(lengths)])
    out = ops.packed_attention(qkv, cu, dim**-0.5)
    assert out.shape == (sum(lengths), 3, dim) and out.dtype == torch.float32
    torch.testing.assert_close(out, _reference(qkv, lengths), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("dim", [32, 64])
def test_bf16_is_the_fp32_result_rounded_once(ops, level, dim):
    lengths = [7, 16, 17, 40, 3]
    qkv = _qkv(lengths, 12, dim, torch.bfloat16, seed=dim)
    cu = torch.tensor([0, *itertools.accumulate(lengths)])
    out = ops.packed_attention(qkv, cu, dim**-0.5)
    assert out.dtype == torch.bfloat16
    exact = _reference(qkv, lengths)
    # within one bf16 rounding of the fp32 result (half a step, 2^-9 relative, plus fp32 noise)
    assert ((out.float() - exact).abs() <= exact.abs() * 2**-8 + 1e-5).all()


def test_every_level_gives_the_same_result(ops):
    if ops.isa() == "scalar":
        pytest.skip("no AVX-512 here")
    lengths = [9, 31, 70]
    qkv = _qkv(lengths, 4, 32, torch.float32, seed=3)
    cu = torch.tensor([0, *itertools.accumulate(lengths)])
    fast = ops.packed_attention(qkv, cu, 0.2)
    ops.set_isa_cap("scalar")
    try:
        plain = ops.packed_attention(qkv, cu, 0.2)
    finally:
        ops.set_isa_cap(kernels.ISA_LEVELS[-1])
    torch.testing.assert_close(fast, plain, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize(
    ("qkv", "cu", "message"),
    [
        (torch.zeros(4, 3, 2, 16), torch.tensor([0, 2, 5]), "run from 0 to 4"),
        (torch.zeros(4, 3, 2, 16), torch.tensor([0, 2, 2, 4]), "sequence 1 is empty"),
        (torch.zeros(4, 3, 2, 16), torch.tensor([0, 4], dtype=torch.int32), "int64"),
        (torch.zeros(4, 2, 2, 16), torch.tensor([0, 4]), "contiguous"),
        (torch.zeros(4, 3, 2, 16, dtype=torch.float16), torch.tensor([0, 4]), "bf16 or fp32"),
    ],
)
def test_malformed_inputs_are_refused(ops, qkv, cu, message):
    with pytest.raises(RuntimeError, match=message):
        ops.packed_attention(qkv, cu, 0.25)

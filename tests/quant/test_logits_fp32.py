"""fp32 logits from a quantized lm_head: an int8 head takes fp32 input and writes fp32 directly."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from edgeinfer.engine.quant.base import get_weight_method
from edgeinfer.engine.quant.layers import QuantLinear, logits_fp32


def _head(method: str, vocab: int = 20_000, hidden: int = 128) -> tuple[QuantLinear, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(vocab, hidden, generator=gen) * 0.05
    return QuantLinear.from_float(w, None, get_weight_method(method)), w


def test_int8_head_writes_fp32_logits_without_rounding_to_the_model_dtype():
    head, w = _head("int8")
    assert head.method.quantizes_activations
    h = torch.randn(3, 128, generator=torch.Generator().manual_seed(1)).bfloat16()
    out = logits_fp32(head, h)
    assert out.dtype == torch.float32
    # the same int8 inputs and fp32 epilogue, so the bf16-input path is exactly this result rounded to bf16
    via_bf16 = head(h).float()
    assert torch.equal(out.bfloat16().float(), via_bf16)
    assert not torch.equal(out, via_bf16)  # fp32 keeps the bits bf16 dropped
    ref = h.float() @ w.t()
    assert (out - ref).abs().max() < 0.05 * ref.abs().max()


def test_wide_int8_head_column_blocks_match_one_block():
    head, _ = _head("int8", vocab=40_000)
    h = torch.randn(40, 128, generator=torch.Generator().manual_seed(2))  # 40 rows: blocks of 26,214 columns
    blocks = logits_fp32(head, h)
    xq, xs = head.method.quantize_rows(head.method.rotate(h))
    t = head.prepared().tensors
    whole = torch._int_mm(xq, t["weight"].t()).float() * xs * t["weight_scale"]
    torch.testing.assert_close(blocks, whole, rtol=1e-6, atol=1e-6)


def test_float_and_weight_only_heads_are_cast_after_the_matmul():
    lin = nn.Linear(64, 500, bias=False).to(torch.bfloat16)
    h = torch.randn(2, 64).bfloat16()
    assert torch.equal(logits_fp32(lin, h), lin(h).float())
    head, _ = _head("int4", vocab=512, hidden=64)
    assert not head.method.quantizes_activations
    assert torch.equal(logits_fp32(head, h), head(h).float())


@pytest.mark.parametrize("method", ["int8", "int4", None])
def test_logits_into_a_reused_buffer_equal_fresh_logits(method):
    head = _head(method)[0] if method else nn.Linear(128, 20_000, bias=False).to(torch.bfloat16)
    buf = torch.full((130, 20_000), float("nan"))
    # 130 rows take int8's column-block path; a smaller later step reuses the front of the buffer
    for rows in (130, 2):
        h = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows)).bfloat16()
        got = logits_fp32(head, h, buf[:rows])
        assert got.data_ptr() == buf.data_ptr()
        assert torch.equal(got, logits_fp32(head, h))

"""The packed int8 GEMV copy (`QuantLinear.attach_gemv`, `--lm-head-gemv`): same results as `_int_mm`."""

from __future__ import annotations

import pytest
import torch

from edgeinfer.engine.config import EngineConfig
from edgeinfer.engine.engine import LLMEngine
from edgeinfer.engine.loading import parse_quantization
from edgeinfer.engine.quant import QuantizationError, QuantLinear
from edgeinfer.engine.quant.int8 import GEMV_ROWS
from edgeinfer.types import SamplingParams


def _layer(method: str = "int8", out: int = 1000, inp: int = 256) -> QuantLinear:
    g = torch.Generator().manual_seed(0)
    return QuantLinear.from_float(torch.randn(out, inp, generator=g) * 0.05, None, parse_quantization(method))


@pytest.mark.parametrize("method", ["int8", "int8:0"])  # with and without the Hadamard rotation
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_copy_is_bit_exact_against_int_mm(method, dtype):
    plain, packed = _layer(method), _layer(method)
    packed.attach_gemv()
    for rows in (1, 3, GEMV_ROWS):
        x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)).to(dtype)
        assert packed.kernel_for(rows) == "fbgemm_gemv" and plain.kernel_for(rows) == "int_mm"
        assert torch.equal(packed(x), plain(x))
        out_a, out_b = torch.empty(rows, 1000), torch.empty(rows, 1000)
        assert torch.equal(packed.forward_into(x.float(), out_a), plain.forward_into(x.float(), out_b))
    assert packed.kernel_for(GEMV_ROWS + 1) == "int_mm"  # wider inputs keep `_int_mm`
    assert packed.weight_nbytes() == plain.weight_nbytes() + 1000 * 256 + 4 * 1000


def test_gemv_copy_refuses_other_methods():
    with pytest.raises(QuantizationError, match="int8"):
        _layer("int4").attach_gemv()


def test_engine_lm_head_gemv_keeps_outputs(tiny_models):
    def engine(gemv: bool) -> LLMEngine:
        model = tiny_models["llama"]
        return LLMEngine(EngineConfig(model=model, quantization="int8", lm_head_gemv=gemv, num_kv_blocks=64))

    plain, packed = engine(False), engine(True)
    assert packed.model.lm_head.kernel_for(1) == "fbgemm_gemv"
    head = packed.model.lm_head
    extra = head.out_features * (head.in_features + 4)
    assert packed.layout.weight_bytes == plain.layout.weight_bytes + extra
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=5)
    prompts = [[5, 9, 17, 33], [2, 4, 6, 8, 10, 12]]
    for a, b in zip(plain.generate(prompts, sp), packed.generate(prompts, sp), strict=True):
        assert a.token_ids == b.token_ids
        assert [o.logprobs for o in a.outputs] == [o.logprobs for o in b.outputs]


def test_engine_lm_head_gemv_needs_an_int8_head(tiny_models):
    with pytest.raises(ValueError, match="lm_head_gemv needs an int8 lm_head"):
        LLMEngine(EngineConfig(model=tiny_models["llama"], dtype="float32", lm_head_gemv=True))


@pytest.mark.parametrize(
    "flags", [[], ["--quantization", "fp8"], ["--quantization", "int4", "--lm-head-quantization", "none"]]
)
def test_serve_refuses_lm_head_gemv_without_an_int8_head(flags, tiny_models, capsys):
    from edgeinfer.node.cli import main

    assert main(["--model", tiny_models["llama"], "--lm-head-gemv", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "lm_head_gemv needs an int8 lm_head on CPU" in err

"""Our CPU kernels' run-time dispatch (kernels/isa.h): every variant this CPU can run matches its
reference, the fallbacks are reached by capping the level, and the bf16 kernel serves float models."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch

from edgeinfer.engine import kernels
from edgeinfer.engine.config import EngineConfig
from edgeinfer.engine.engine import LLMEngine
from edgeinfer.engine.kernels.bf16 import GemvLinear
from edgeinfer.engine.kernels.limits import KernelLimits
from edgeinfer.engine.loading import parse_quantization, uses_cpu_gemv
from edgeinfer.engine.quant import QuantLinear
from edgeinfer.types import SamplingParams


def _levels_here(ops) -> list[str]:
    """The levels this CPU runs: a cap at a level the CPU lacks reports a lower one."""
    here = []
    for level in kernels.ISA_LEVELS:
        ops.set_isa_cap(level)
        if ops.isa() == level:
            here.append(level)
    ops.set_isa_cap(kernels.ISA_LEVELS[-1])
    return here


@pytest.fixture
def capped(ops) -> Iterator:
    """Set the cap inside a test; lifted afterwards."""
    yield ops.set_isa_cap
    ops.set_isa_cap(kernels.ISA_LEVELS[-1])


def _bf16(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


# K: whole vectors, and tails that the masked / scalar remainders take; N: whole and partial tiles
@pytest.mark.parametrize("n,k", [(256, 640), (37, 100), (5, 7), (130, 2048)])
def test_bf16_gemv_matches_a_float64_product_at_every_level_the_cpu_has(ops, capped, n, k):
    w = _bf16(n, k, seed=n)
    for level in _levels_here(ops):
        capped(level)
        assert ops.bf16_variant() == (level if level != "avx512_vnni" else "avx512")
        for m in (1, 3, 6, 37):  # one tile of rows, a partial one, more than one, several chunks
            x = _bf16(m, k, seed=m)
            ref = x.double() @ w.double().T
            out = torch.empty(m, n)
            ops.bf16_gemv_out(x, w, out)
            # fp32 sums of k bf16 products: rounding within k * 2^-24 of the magnitudes summed
            bound = k * 2.0**-23 * (x.double().abs() @ w.double().abs().T) + 1e-30
            assert ((out.double() - ref).abs() <= bound).all(), level
            assert torch.equal(ops.bf16_gemv(x, w), out.bfloat16())  # bf16 out: the fp32 sums, rounded


@pytest.mark.parametrize("k", [640, 100])
def test_bf16_gemv_rows_do_not_depend_on_the_batch_or_threads(ops, k):
    """Each row alone, in batches of every tile shape (4 x 4 tiles, 1-3 rows left over) and past an L1
    chunk of rows, on 1 or 2 threads: the same bits."""
    w, x = _bf16(1000, k, seed=0), _bf16(45, k, seed=1)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        together = ops.bf16_gemv(x, w)
        torch.set_num_threads(2)
        assert torch.equal(ops.bf16_gemv(x, w), together)
        assert all(torch.equal(ops.bf16_gemv(x[i : i + 1], w), together[i : i + 1]) for i in range(45))
        for start, stop in ((0, 2), (3, 6), (5, 12), (1, 30)):
            assert torch.equal(ops.bf16_gemv(x[start:stop], w), together[start:stop])
    finally:
        torch.set_num_threads(threads)


# int8 row-major (more outputs than inputs) and `[K, N]` (more inputs: partial 16-output chunks, an odd
# input count); int4 at each group size
@pytest.mark.parametrize(
    "method,out,inp",
    [
        ("int8:0", 512, 256),
        ("int8:0", 200, 701),
        ("int4", 512, 256),
        ("int4:32", 64, 640),
        ("int4:128", 128, 256),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int_kernels_fallback_equals_the_fast_variant(ops, capped, method, out, inp, dtype):
    """Also for bf16 inputs, whose int4 activation codes are taken by AVX-512 loops where the CPU has them."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(out, inp, generator=g) * 0.05
    layer = QuantLinear.from_float(weight, None, parse_quantization(method))
    assert layer.use_cpu_gemv()
    results = {}
    for level in _levels_here(ops):
        capped(level)
        results[level] = [
            layer(torch.randn(rows, inp, generator=g.manual_seed(rows)).to(dtype)) for rows in (1, 3, 6)
        ]
    assert "scalar" in results and (len(results) > 1) == kernels.cpu_has_avx2()
    # the VNNI and AVX2 variants and the plain loops do the same integer sums and the same float epilogue
    for level, ys in results.items():
        assert all(torch.equal(y, ref) for y, ref in zip(ys, results["scalar"], strict=True)), level


def test_the_env_var_caps_the_level_in_a_fresh_process(ops):
    code = (
        "import torch; from edgeinfer.engine import kernels; kernels.load(); "
        "print(torch.ops.edgeinfer_cpu.isa())"
    )
    env = {**os.environ, kernels.ISA_ENV: "scalar"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "scalar"


def test_an_op_loads_the_kernels_where_nothing_has(ops):
    code = "from edgeinfer.engine.kernels import ops; print(ops.isa())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() in kernels.ISA_LEVELS


def test_an_unknown_level_is_refused_before_building(monkeypatch):
    monkeypatch.setenv(kernels.ISA_ENV, "avx9000")
    kernels.load.cache_clear()
    try:
        with pytest.raises(kernels.KernelBuildError, match="avx9000"):
            kernels.load()
    finally:
        monkeypatch.delenv(kernels.ISA_ENV)
        kernels.load.cache_clear()
        kernels.load()


def _engine(model: str, cpu_gemv: bool | None, dtype: str = "auto") -> LLMEngine:
    return LLMEngine(EngineConfig(model=model, dtype=dtype, cpu_gemv=cpu_gemv, num_kv_blocks=64))


def test_bf16_models_take_the_kernel_by_default_and_decode_alike(ops, tiny_models):
    plain, fast = _engine(tiny_models["gemma3"], False), _engine(tiny_models["gemma3"], None)
    assert not uses_cpu_gemv(plain.model)
    assert uses_cpu_gemv(fast.model) == kernels.cpu_has_avx2()
    head, embed = fast.model.lm_head, fast.model.model.embed_tokens
    if kernels.cpu_has_avx2():
        assert isinstance(head, GemvLinear) and head.weight is embed.weight  # still tied, no copy
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)
    prompts = [[5, 9, 17, 33], [2, 4, 6, 8, 10, 12]]
    for a, b in zip(plain.generate(prompts, sp), fast.generate(prompts, sp), strict=True):
        # fp32 sums in another order: the same tokens until a near-tie, logprobs within bf16 rounding
        for pa, pb in zip(a.outputs, b.outputs, strict=True):
            (ta,), (tb,) = pa.logprobs, pb.logprobs
            assert tb.logprob == pytest.approx(ta.logprob, abs=0.05)
            if ta.token_id != tb.token_id:
                assert ta.top[0][1] - ta.top[1][1] < 0.05
                break


def test_fp32_models_never_start_the_build(tiny_models, monkeypatch):
    def unexpected() -> None:
        raise AssertionError("an fp32 model started the kernel build")

    monkeypatch.setattr(kernels, "load", unexpected)
    assert not uses_cpu_gemv(_engine(tiny_models["llama"], None, "float32").model)


def test_gemv_linear_keeps_torch_for_wide_inputs(ops):
    lin = torch.nn.Linear(64, 48, bias=True, dtype=torch.bfloat16)
    fast = GemvLinear.from_linear(lin, max_rows=4)  # a CPU's limit (AMX: 2, AVX-512: 16)
    x = _bf16(5, 64, seed=3)
    assert not fast.uses_kernel(x) and torch.equal(fast(x), lin(x))
    one = x[:1]
    assert fast.uses_kernel(one)
    assert torch.allclose(fast(one).float(), lin(one).float(), atol=0.03, rtol=0.01)  # the bias is added


def test_bf16_decode_products_take_the_kernel_up_to_the_default_batch_where_it_has_tiles():
    base = frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512vl"})

    def rows(flags: frozenset[str]) -> int:
        return KernelLimits.for_flags(flags).bf16_gemv_rows

    assert rows(base | {"avx512_bf16"}) == EngineConfig().max_num_seqs == 64
    assert rows(base | {"avx512_bf16", "amx_bf16"}) == 2  # oneDNN's AMX GEMM from 4 rows
    assert rows(base) == 16
    assert rows(frozenset({"avx2", "fma"})) == 64  # no bf16 GEMM of oneDNN's to hand products to

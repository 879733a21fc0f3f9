"""Our CPU GEMV kernels (engine/kernels, `--cpu-gemv`, default where the CPU has AVX2): int8 bit for
bit as `_int_mm`, int4 as W4A8."""

from __future__ import annotations

import pytest
import torch
from helpers.kernels import require_gemv_kernels

from edgeinfer.engine import kernels
from edgeinfer.engine.config import EngineConfig
from edgeinfer.engine.engine import LLMEngine
from edgeinfer.engine.loading import parse_quantization
from edgeinfer.engine.quant import QuantLinear
from edgeinfer.engine.quant.experts import quantize_expert_weights
from edgeinfer.engine.quant.int4 import Int4Method, _int4pack_codes
from edgeinfer.types import SamplingParams

GEMV_ROWS = kernels.GEMV_ROWS


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    require_gemv_kernels()


def _layer(method: str, out: int = 1000, inp: int = 256) -> QuantLinear:
    g = torch.Generator().manual_seed(0)
    return QuantLinear.from_float(torch.randn(out, inp, generator=g) * 0.05, None, parse_quantization(method))


def _x(rows: int, inp: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(rows, inp, generator=torch.Generator().manual_seed(rows)).to(dtype)


@pytest.mark.parametrize("method", ["int8", "int8:0"])  # with and without the Hadamard rotation
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_gemv_is_bit_exact_against_int_mm(method, dtype):
    plain, fast = _layer(method), _layer(method)
    assert fast.use_cpu_gemv()
    for rows in (1, 3, 5, GEMV_ROWS):
        x = _x(rows, 256, dtype)
        assert fast.kernel_for(rows) == "cpu_gemv" and plain.kernel_for(rows) == "int_mm"
        assert torch.equal(fast(x), plain(x))
        out_a, out_b = torch.empty(rows, 1000), torch.empty(rows, 1000)
        assert torch.equal(fast.forward_into(x.float(), out_a), plain.forward_into(x.float(), out_b))
    assert fast.kernel_for(GEMV_ROWS + 1) == "int_mm"  # wider inputs keep `_int_mm`
    assert fast.weight_nbytes() == plain.weight_nbytes()  # the same codes, no second copy


def test_int8_gemv_handles_rows_that_are_not_whole_vectors():
    plain, fast = _layer("int8:0", 256, 200), _layer("int8:0", 256, 200)  # 200 = 3 x 64 + 8
    assert fast.use_cpu_gemv()
    x = _x(2, 200)
    assert torch.equal(fast(x), plain(x))


@pytest.mark.parametrize("method", ["int8", "int8:0"])
# K > N, so stored [K, N]; K not a multiple of 4 and N not of 64 take the masked tails
@pytest.mark.parametrize("shape", [(100, 1001), (640, 2048), (7, 9)])
def test_int8_gemv_on_kn_stored_weights_is_bit_exact(method, shape):
    out, inp = shape
    plain, fast = _layer(method, out, inp), _layer(method, out, inp)
    assert "weight_t" in plain.prepared().tensors  # stored [K, N] for `_int_mm`
    assert fast.use_cpu_gemv()
    for rows in range(1, kernels.GEMV_KN_ROWS + 1):
        assert fast.kernel_for(rows) == "cpu_gemv"
        for dtype in (torch.float32, torch.bfloat16):
            x = _x(rows, inp, dtype)
            assert torch.equal(fast(x), plain(x))
    assert fast.kernel_for(kernels.GEMV_KN_ROWS + 1) == "int_mm"  # slower than `_int_mm` from there
    assert fast.weight_nbytes() == plain.weight_nbytes()


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_codes_come_back_exactly_from_the_cpu_layout(group):
    m = Int4Method(group)
    state = m.quantize(torch.randn(192, 256, generator=torch.Generator().manual_seed(1)))
    prepared = m.prepare(state, "cpu")
    q, zero_term, scale = _int4pack_codes(prepared.tensors, 256)
    u = m.unpack(state)
    assert torch.equal(q, u["q"]) and torch.equal(scale, u["scale"])
    want = ((8 - u["zero"].float()) * u["scale"].float()).to(torch.bfloat16)  # the CPU layout's zero term
    assert torch.equal(zero_term, want)


def _w4a8_reference(x: torch.Tensor, state: dict[str, torch.Tensor], m: Int4Method) -> torch.Tensor:
    """W4A8 in float64: activations rounded per group of the weight's, then exact sums, on the weight of
    the CPU layout, `(q - 8) * scale + bf16((8 - zp) * scale)`."""
    g = m.group_size
    u = m.unpack(state)
    xg = x.double().unflatten(-1, (-1, g))
    xs = xg.abs().amax(-1, keepdim=True) / 127
    xq = torch.where(xs > 0, torch.round(xg / xs), 0).clamp(-127, 127) * xs
    scale = u["scale"].double()
    zero_term = ((8 - u["zero"].float()) * u["scale"].float()).to(torch.bfloat16).double()
    q = u["q"].double().unflatten(-1, (-1, g))
    w = (q - 8) * scale.unsqueeze(-1) + zero_term.unsqueeze(-1)
    return xq.flatten(-2) @ w.flatten(-2).t()


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_gemv_is_w4a8(group, dtype):
    method = f"int4:{group}"
    plain, fast = _layer(method, 256, 512), _layer(method, 256, 512)
    assert fast.use_cpu_gemv() and fast.kernel == "cpu_w4a8"
    m = fast.method
    state = m.quantize(torch.randn(256, 512, generator=torch.Generator().manual_seed(0)) * 0.05)
    for rows in (1, 3, 5, 17, 64):  # every row count: 4 at a time, then the rest
        x = _x(rows, 512, dtype)
        assert fast.kernel_for(rows) == "cpu_w4a8"
        y = fast(x)
        assert y.dtype == dtype
        ref = _w4a8_reference(x, state, m)
        # fp32 sums of exact int32 group dots; a bf16 output rounds once more (half a unit in 2^8)
        bf16 = dtype == torch.bfloat16
        atol = ref.abs().max().item() * (2**-8 if bf16 else 1e-6)
        torch.testing.assert_close(y.double(), ref, rtol=2**-8 if bf16 else 1e-5, atol=atol)
        # against int4 x float activations: the int8 rounding of x costs < 1 % here
        w16 = plain(x.float())
        assert ((y.float() - w16).norm() / w16.norm()) < 0.01


def test_int4_gemv_form_is_smaller_than_torchs():
    plain, fast = _layer("int4", 256, 512), _layer("int4", 256, 512)
    assert fast.use_cpu_gemv()
    assert fast.weight_nbytes() == 256 * 512 // 2 + 4 * 256 * 512 // 32  # codes, bf16 scales, zero terms
    assert fast.weight_nbytes() < plain.weight_nbytes()


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("shape", [(4, 64, 256), (3, 256, 64)])  # [experts, out, in]: K > N and K < N
def test_expert_stacks_take_the_kernels_expert_by_expert(method, shape):
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(2)) * 0.05
    plain, fast = (quantize_expert_weights(w, parse_quantization(method)) for _ in range(2))
    assert fast.use_cpu_gemv() and fast.kernel in kernels.KERNELS
    assert fast.weight_nbytes() <= plain.weight_nbytes()
    ids = torch.tensor([0, 2, 1, 0, 2, 2])
    x = _x(len(ids), shape[2])
    want, got = plain.grouped_linear(x, ids), fast.grouped_linear(x, ids)
    if method == "int8":
        assert torch.equal(got, want)
    else:  # W4A8 against W4A16
        assert torch.allclose(got, want, atol=0.02 * want.abs().max().item())


def _engine(model: str, quantization: str | None, cpu_gemv: bool | None) -> LLMEngine:
    return LLMEngine(
        EngineConfig(model=model, quantization=quantization, cpu_gemv=cpu_gemv, num_kv_blocks=64)
    )


PROMPTS = [[5, 9, 17, 33], [2, 4, 6, 8, 10, 12]]


def test_engine_int8_cpu_gemv_keeps_outputs(tiny_models):
    plain, fast = _engine(tiny_models["llama"], "int8", False), _engine(tiny_models["llama"], "int8", True)
    assert fast.model.lm_head.kernel_for(1) == "cpu_gemv"
    assert fast.layout.weight_bytes == plain.layout.weight_bytes
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=5)
    for a, b in zip(plain.generate(PROMPTS, sp), fast.generate(PROMPTS, sp), strict=True):
        assert a.token_ids == b.token_ids
        assert [o.logprobs for o in a.outputs] == [o.logprobs for o in b.outputs]


def test_engine_int4_cpu_gemv_decodes_like_w4a16(tiny_models):
    plain, fast = _engine(tiny_models["llama"], "int4", False), _engine(tiny_models["llama"], "int4", True)
    kinds = {m.kernel for m in fast.model.modules() if isinstance(m, QuantLinear)}
    assert {"cpu_w4a8", "cpu_gemv"} <= kinds  # the int4 body and the int8 lm_head
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)
    for a, b in zip(plain.generate(PROMPTS, sp), fast.generate(PROMPTS, sp), strict=True):
        # the same tokens, with logprobs within 0.02, until the greedy paths part; they may part only at a
        # near-tie (the random tiny model's top two logprobs are often within 0.01), never at a clear choice
        for pa, pb in zip(a.outputs, b.outputs, strict=True):
            (ta,), (tb,) = pa.logprobs, pb.logprobs
            assert tb.logprob == pytest.approx(ta.logprob, abs=0.02)
            if ta.token_id != tb.token_id:
                assert ta.top[0][1] - ta.top[1][1] < 0.02
                break


def _kernels_used(engine: LLMEngine) -> set[str]:
    return {m.kernel for m in engine.model.modules() if isinstance(m, QuantLinear)} & set(kernels.KERNELS)


def test_kernels_are_the_default_where_the_cpu_has_avx2(tiny_models):
    auto = _engine(tiny_models["llama"], "int4", None)
    expected = {"cpu_w4a8", "cpu_gemv"} if kernels.cpu_has_avx2() else set()
    assert _kernels_used(auto) == expected
    assert not _kernels_used(_engine(tiny_models["llama"], "int4", False))  # --no-cpu-gemv


def test_default_leaves_cpus_without_avx2_on_torchs_kernels(tiny_models, monkeypatch):
    monkeypatch.setattr(kernels, "cpu_has_avx2", lambda: False)  # the kernels would run as plain loops
    assert not _kernels_used(_engine(tiny_models["llama"], "int4", None))
    assert _kernels_used(_engine(tiny_models["llama"], "int4", True))  # asked for, they still run


def test_default_keeps_torchs_kernels_when_the_build_fails(tiny_models, monkeypatch, caplog):
    def broken() -> None:
        raise kernels.KernelBuildError("could not build the CPU GEMV kernels: no compiler")

    monkeypatch.setattr(kernels, "cpu_has_avx2", lambda: True)
    monkeypatch.setattr(kernels, "load", broken)
    auto = _engine(tiny_models["llama"], "int8", None)
    assert not _kernels_used(auto) and auto.model.lm_head.kernel_for(1) == "int_mm"
    assert "keep torch's kernels" in caplog.text
    with pytest.raises(ValueError, match="cpu_gemv: could not build"):  # asked for, it is an error
        _engine(tiny_models["llama"], "int8", True)


def test_default_never_builds_for_fp8_models(tiny_models, monkeypatch):
    def unexpected() -> None:
        raise AssertionError("an fp8 model started the kernel build")

    monkeypatch.setattr(kernels, "cpu_has_avx2", lambda: True)
    monkeypatch.setattr(kernels, "load", unexpected)
    assert not _kernels_used(_engine(tiny_models["llama"], "fp8", None))


@pytest.mark.parametrize("flags", [["--dtype", "float32"], ["--quantization", "fp8"]])
def test_serve_refuses_cpu_gemv_without_kernel_weights(flags, tiny_models, capsys):
    from edgeinfer.node.cli import main

    assert main(["--model", tiny_models["llama"], "--cpu-gemv", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "cpu_gemv needs int8, int4 or bf16 weights on CPU" in err


# int8 without the rotation: torch's rotation matmul itself may round differently on two threads
@pytest.mark.parametrize("method", ["int8:0", "int4"])
def test_kernels_split_rows_across_threads_without_changing_results(method):
    layer = _layer(method, 4096, 256)  # int8: 4 blocks of 1,024 rows; int4: 256 tiles of 16 rows
    assert layer.use_cpu_gemv()
    x = _x(3, 256)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = layer(x)
        torch.set_num_threads(2)
        assert torch.equal(layer(x), one)
    finally:
        torch.set_num_threads(threads)

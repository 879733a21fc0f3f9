"""The fused decode step (kernels/dense_step.cpp, model/fused_decode.py) against the eager path it
replaces: the same kernels and ATen ops in the same order, so the same logits bit for bit."""

from __future__ import annotations

import pytest
import torch
from helpers.fused_step import assert_fused_step_decodes_as_eager, bf16_engine, greedy_answers

from edgeinfer.engine import kernels
from edgeinfer.engine.kernels.limits import KernelLimits
from edgeinfer.engine.runtime import runtime, start_runtime

# the second spans two KV blocks of 16; together they make decode steps of 4 sequences
PROMPTS = [[3, 14, 15, 92, 65], list(range(4, 26)), [7] * 9, list(range(100, 140))]
MAX_TOKENS = 12


@pytest.fixture(params=["default", "narrow"])
def limits(request):
    """The eager path's limits as they are, or so small that a batch of 4 crosses both: products of more
    than one row go to torch's GEMM, inputs of more than 64 values to torch's norm and rotation."""
    before = runtime()
    if request.param == "narrow":
        start_runtime(before.threads, KernelLimits(bf16_gemv_rows=1, decode_op_elements=64))
    yield request.param
    start_runtime(before.threads, before.kernels)


@pytest.mark.parametrize("quantization", [None, "int4"], ids=["bf16", "int4"])
@pytest.mark.parametrize("family", ["gemma3", "qwen3", "llama", "llama_bias"])
def test_fused_step_decodes_as_the_eager_path_bit_for_bit(level, tiny_models, family, quantization, limits):
    if not kernels.cpu_has_avx2():
        pytest.skip("bf16 models keep torch's kernels without AVX2")
    engine = bf16_engine(tiny_models[family], quantization=quantization)
    assert_fused_step_decodes_as_eager(engine, PROMPTS, MAX_TOKENS)


def test_models_outside_the_kernels_keep_the_eager_step(ops, tiny_models):
    # an int4 KV cache: the decode ops read bf16, int8 and float8 blocks only (tests/quant/test_kv_decode.py)
    assert bf16_engine(tiny_models["qwen3"], kv_cache_dtype="int4").runner.fused is None
    # int8 weights multiply through another kernel the step does not call
    assert bf16_engine(tiny_models["llama"], quantization="int8").runner.fused is None
    # torch's kernels asked for: no decode ops, no fused step
    assert bf16_engine(tiny_models["llama"], cpu_gemv=False).runner.fused is None


def test_fused_step_refuses_inputs_it_cannot_run(ops):
    limits = runtime().kernels
    step = torch.classes.edgeinfer_cpu.DenseDecodeStep(limits.bf16_gemv_rows, limits.decode_op_elements)
    with pytest.raises(RuntimeError, match="no tensor 'input_norm'"):
        step.add_layer({}, {})
    with pytest.raises(RuntimeError, match="bf16"):
        slots = torch.zeros(2, dtype=torch.long)
        step.run(torch.zeros(2, 8), [], [], slots, torch.zeros(2, 1), torch.ones(2), None)
    plan = torch.zeros(2, dtype=torch.long)
    with pytest.raises(RuntimeError, match="no layer 0"):
        step.set_lora(torch.zeros(1, dtype=torch.long), [0], ["qkv"], [[]], [[]], [plan])
    with pytest.raises(RuntimeError, match="rows must be a contiguous int64"):
        step.set_lora(torch.zeros(1, dtype=torch.int32), [], [], [], [], [])


def test_compile_leaves_a_model_the_fused_step_takes_to_it(ops, tiny_models):
    # the fused step is faster than the compiled one-sequence graph and takes batched steps too: asking
    # for compile compiles nothing (no warm-up, no graph) and decodes as the plain engine does
    plain = bf16_engine(tiny_models["gemma3"])
    compiled = bf16_engine(tiny_models["gemma3"], compile=True)
    assert compiled.runner.fused is not None and compiled.runner.compiled is None
    assert compiled.runner.num_steps == 0  # no warm-up generation ran
    answers = [greedy_answers(e, PROMPTS, MAX_TOKENS, together=True) for e in (compiled, plain)]
    assert answers[0] == answers[1]
    # a model the fused step does not take still compiles (int8 weights)
    assert bf16_engine(tiny_models["llama"], quantization="int8", compile=True).runner.compiled is not None

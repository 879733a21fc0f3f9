"""The fused one-sequence decode step (quant/kernels/dense_step.cpp, model/fused_decode.py) against the
eager kernel path it replaces: the same kernels in the same order, so the same logits bit for bit."""

from __future__ import annotations

import pytest
import torch

from edgeinfer.engine.config import EngineConfig
from edgeinfer.engine.engine import LLMEngine
from edgeinfer.engine.quant import kernels
from edgeinfer.types import SamplingParams

PROMPTS = [[3, 14, 15, 92, 65], list(range(4, 26))]  # the second spans two KV blocks of 16


def _engine(model: str, **overrides) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model, dtype="bfloat16", num_kv_blocks=64, **overrides))


def _decode(engine: LLMEngine) -> list[tuple[list[int], list[float]]]:
    """Greedy answers with their logprobs, one request at a time (each decode step has one sequence)."""
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3)
    out = []
    for prompt in PROMPTS:
        (c,) = engine.generate([prompt], sp)
        lps = [lp for o in c.outputs for lp in o.logprobs]
        assert len(lps) == sp.max_tokens
        out.append(([t.token_id for t in lps], [t.logprob for t in lps] + [p for t in lps for _, p in t.top]))
    return out


@pytest.mark.parametrize("quantization", [None, "int4"], ids=["bf16", "int4"])
@pytest.mark.parametrize("family", ["gemma3", "qwen3", "llama", "llama_bias"])
def test_fused_step_decodes_as_the_eager_kernels_bit_for_bit(level, tiny_models, family, quantization):
    if not kernels.cpu_has_avx2():
        pytest.skip("bf16 models keep torch's kernels without AVX2")
    engine = _engine(tiny_models[family], quantization=quantization)
    fused = engine.runner.fused
    assert fused is not None, "every layer of this model runs on our kernels: the fused step takes it"
    calls = 0

    def counted(*args):
        nonlocal calls
        calls += 1
        return fused(*args)

    engine.runner.fused = counted
    with_fused = _decode(engine)
    assert calls == len(PROMPTS) * 11  # every decode step after each prompt's prefill
    engine.runner.fused = None
    assert _decode(engine) == with_fused


def test_models_outside_the_kernels_keep_the_eager_step(ops, tiny_models):
    # a quantized KV cache: the decode op attends over plain bf16 blocks only
    assert _engine(tiny_models["llama"], kv_cache_dtype="int8").runner.fused is None
    # int8 weights multiply through another kernel the step does not call
    assert _engine(tiny_models["llama"], quantization="int8").runner.fused is None
    # torch's kernels asked for: no decode ops, no fused step
    assert _engine(tiny_models["llama"], cpu_gemv=False).runner.fused is None


def test_fused_step_refuses_inputs_it_cannot_run(ops):
    step = torch.classes.edgeinfer_cpu.DenseDecodeStep()
    with pytest.raises(RuntimeError, match="no tensor 'input_norm'"):
        step.add_layer({}, {})
    with pytest.raises(RuntimeError, match="one bf16 row"):
        step.run(torch.zeros(2, 8, dtype=torch.bfloat16), [], [], 0, torch.zeros(1, dtype=torch.long), 1)

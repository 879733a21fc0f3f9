"""Compiled one-sequence steps run without Dynamo's guards on module state (model/compile.py's
`guard_filter_fn`): models of one class compiled in one process must each get a graph of their own (each
model compiles a forward with its own code object) and decode as they do eagerly, including two that differ
only in what their modules do (int8 with and without the Hadamard rotation: with a shared graph, the second
one decoded garbage)."""

from __future__ import annotations

import pytest
from helpers.tiny_models import make_tiny
from torch._dynamo.utils import counters

from edgeinfer.types import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1)


@pytest.mark.slow
def test_models_of_one_class_compile_separately(tiny_models, tmp_path, engine_factory):
    deeper = make_tiny("llama", tmp_path / "deeper", seed=1, num_hidden_layers=3, intermediate_size=192)
    llama = tiny_models["llama"]
    # each compiles after the ones before it
    for model, quantization in ((llama, None), (str(deeper), None), (llama, "int8"), (llama, "int8:0")):
        kw = {"dtype": "float32", "quantization": quantization}
        eager = engine_factory(model, **kw).generate([[5, 9, 17]], GREEDY)[0]
        engine = engine_factory(model, compile=True, **kw)
        compiled = engine.generate([[5, 9, 17]], GREEDY)[0]
        assert engine.runner.compiled.compiled is not None  # the graph ran: no fallback to eager
        assert compiled.token_ids == eager.token_ids
        got = [o.logprobs[0].logprob for o in compiled.outputs]
        assert got == pytest.approx([o.logprobs[0].logprob for o in eager.outputs], abs=1e-3)


@pytest.mark.slow
def test_compiled_step_is_kept_by_aotautograds_cache(tiny_models, engine_factory):
    """Each start traces the step again; its compiled form should come from the caches on disk. AOTAutograd's
    cache refuses a graph holding a `torch.tensor` call (Gemma's embedding scale, the decodes' context
    lengths, once), and without it every start compiled again from inductor's FX graphs (Gemma 3 270M int4:
    ~38 s of a second start instead of ~29 s)."""
    counters.clear()
    # fp32: a bf16 model on our kernels takes the fused decode step instead and compiles nothing
    engine = engine_factory(tiny_models["gemma3"], compile=True, dtype="float32")
    assert engine.runner.compiled.compiled is not None
    aot = counters["aot_autograd"]
    assert aot["autograd_cache_bypass"] == 0
    assert aot["autograd_cache_miss"] + aot["autograd_cache_hit"] > 0  # the cache was asked

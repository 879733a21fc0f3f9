"""Compiled one-sequence steps run without Dynamo's guards on module state (model/compile.py's
`guard_filter_fn`): two models of one class compiled in one process must still get a graph each, and
decode as they do eagerly."""

from __future__ import annotations

import pytest
from helpers.tiny_models import make_tiny

from edgeinfer.types import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1)


@pytest.mark.slow
def test_two_models_of_one_class_compile_separately(tiny_models, tmp_path, engine_factory):
    deeper = make_tiny("llama", tmp_path / "deeper", seed=1, num_hidden_layers=3, intermediate_size=192)
    for model in (tiny_models["llama"], str(deeper)):  # the second one compiles after the first
        eager = engine_factory(model, dtype="float32").generate([[5, 9, 17]], GREEDY)[0]
        compiled = engine_factory(model, dtype="float32", compile=True).generate([[5, 9, 17]], GREEDY)[0]
        assert compiled.token_ids == eager.token_ids
        got = [o.logprobs[0].logprob for o in compiled.outputs]
        assert got == pytest.approx([o.logprobs[0].logprob for o in eager.outputs], abs=1e-3)

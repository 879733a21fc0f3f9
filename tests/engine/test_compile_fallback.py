"""`EngineConfig.compile` routes the dense layers through torch.compile; a compile failure (no C++
compiler on the machine, an unsupported op) must leave the engine serving the same tokens eagerly.
Compiling for real takes tens of seconds, so it is measured in bench runs, not here."""

from __future__ import annotations

import torch

from edgeinfer.engine.model import compile as compile_mod
from edgeinfer.types import SamplingParams

PROMPTS = [list(range(5, 45)), [7, 8, 9]]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def test_compile_failure_falls_back_to_eager(tiny_models, engine_factory, monkeypatch):
    eng = engine_factory(tiny_models["gemma3"])
    want = [r.token_ids for r in eng.generate(PROMPTS, GREEDY)]
    calls = []

    def failing_compile(fn, **_):
        def run(*args):
            calls.append(fn.__qualname__)
            raise RuntimeError("no C++ compiler")

        return run

    monkeypatch.setattr(torch, "compile", failing_compile)
    assert compile_mod.compile_decoder_layers(eng.model)
    assert [r.token_ids for r in eng.generate(PROMPTS, GREEDY)] == want
    # each compiled function failed once, then ran eagerly for good
    assert sorted(calls) == ["DecoderLayer.post_attention", "DecoderLayer.pre_attention"]

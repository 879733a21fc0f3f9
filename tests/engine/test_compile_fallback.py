"""`EngineConfig.compile` runs one-sequence decode steps through torch.compile; a compile failure (no C++
compiler on the machine, an unsupported op) must leave the engine serving the same tokens eagerly.
Compiling Gemma takes minutes on these CPUs, so its speed is measured in bench runs; tiny models compile for
real in test_compile_models.py."""

from __future__ import annotations

import torch

from edgeinfer.engine.runner import runner as runner_mod
from edgeinfer.types import SamplingParams

PROMPTS = [list(range(5, 45)), [7, 8, 9]]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def test_compile_failure_falls_back_to_eager(tiny_models, engine_factory, monkeypatch):
    # fp32: a bf16 model on our kernels takes the fused decode step instead and compiles nothing
    eager = engine_factory(tiny_models["gemma3"], dtype="float32")
    want = [r.token_ids for r in eager.generate(PROMPTS, GREEDY)]
    calls: list[int] = []

    def failing_compile(fn, **_):
        def run(ids, *args):
            calls.append(ids.shape[0])
            raise RuntimeError("no C++ compiler")

        return run

    monkeypatch.setattr(torch, "compile", failing_compile)
    eng = engine_factory(tiny_models["gemma3"], compile=True, dtype="float32")
    assert isinstance(eng.runner.compiled, runner_mod.DecodeCompiledForward)
    # the engine compiles at load, in a warm-up whose one-sequence decode step tries the graph once (one
    # token in); after the failure every step runs eagerly for good, with the same tokens
    assert calls == [1] and eng.runner.compiled.compiled is None
    assert [r.token_ids for r in eng.generate(PROMPTS, GREEDY)] == want
    assert [r.token_ids for r in eng.generate(PROMPTS[1:], GREEDY)] == want[1:]
    assert calls == [1]

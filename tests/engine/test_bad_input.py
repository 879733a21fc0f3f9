"""Bad requests get a one-line error and leak nothing; the engine keeps serving."""

from __future__ import annotations

import json
import shutil

import pytest

from edgeinfer.engine.errors import EngineInputError
from edgeinfer.engine.model.hf_config import ConfigError
from edgeinfer.types import EngineRequest, SamplingParams


def test_prompt_longer_than_context(tiny_llama, engine_factory):
    eng = engine_factory(tiny_llama, max_model_len=64)
    with pytest.raises(EngineInputError, match="maximum context length is 64 tokens"):
        eng.add_request(EngineRequest("long", list(range(3, 70)), SamplingParams()))
    (ok,) = eng.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0.0))
    assert len(ok.token_ids) >= 1


def test_out_of_vocab_and_empty_prompt(tiny_llama, engine_factory):
    eng = engine_factory(tiny_llama)
    with pytest.raises(EngineInputError, match="vocabulary"):
        eng.add_request(EngineRequest("oov", [5, 10**6], SamplingParams()))
    with pytest.raises(EngineInputError, match="empty"):
        eng.add_request(EngineRequest("empty", [], SamplingParams()))
    assert not eng.has_unfinished_requests()


def test_generation_stops_at_the_context_limit(tiny_llama, engine_factory):
    eng = engine_factory(tiny_llama, max_model_len=16)
    (res,) = eng.generate(
        [list(range(3, 13))], SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    )
    assert len(res.token_ids) == 6 and res.finish_reason.value == "length"


def test_abort_mid_generation_frees_every_block(tiny_llama, engine_factory):
    eng = engine_factory(tiny_llama)
    for i in range(3):
        eng.add_request(
            EngineRequest(f"r{i}", list(range(5, 40)), SamplingParams(max_tokens=50, ignore_eos=True))
        )
    for _ in range(4):
        eng.step()
    assert eng.stats().num_free_blocks < eng.stats().num_total_blocks
    outs = [eng.abort(f"r{i}") for i in range(3)]
    assert all(o is not None and o.finished and o.finish_reason.value == "abort" for o in outs)
    assert eng.abort("r0") is None  # aborting twice is harmless
    eng.check_integrity()


def test_unknown_architecture_is_a_clear_error(tiny_llama, tmp_path):
    from engine.conftest import make_engine

    bad = tmp_path / "bad"
    shutil.copytree(tiny_llama, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["FancyNewForCausalLM"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="FancyNewForCausalLM"):
        make_engine(str(bad))


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    from engine.conftest import make_engine

    with pytest.raises(ValueError, match="nope"):
        make_engine(str(tmp_path / "nope"))


def test_nan_request_fails_alone_and_leaves_no_poison(tiny_llama, tmp_path):
    """A request whose logits turn NaN fails with an error; requests running with it, and later ones that
    reuse its freed blocks, produce exactly what a clean engine produces."""
    import math

    from engine.conftest import make_engine
    from safetensors.torch import load_file, save_file

    from edgeinfer.types import FinishReason

    poisoned = tmp_path / "poisoned"
    shutil.copytree(tiny_llama, poisoned)
    weights = next(poisoned.glob("*.safetensors"))
    tensors = load_file(weights)
    tensors["model.embed_tokens.weight"][7] = math.nan  # token 7 poisons whoever reads it
    save_file(tensors, weights, metadata={"format": "pt"})
    sp = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    good = [[3, 4, 5], [9, 10, 11, 12, 13]]
    clean = [r.token_ids for r in make_engine(str(tiny_llama), num_kv_blocks=16).generate(good, sp)]
    eng = make_engine(str(poisoned), num_kv_blocks=16)
    eng.add_request(EngineRequest("bad", [3, 7, 5], sp))
    eng.add_request(EngineRequest("good0", good[0], sp))
    outs = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            outs.setdefault(o.request_id, []).append(o)
            if o.request_id == "good0" and len(outs["good0"]) == 2:
                eng.add_request(EngineRequest("good1", good[1], sp))  # reuses the failed request's blocks
    assert outs["bad"][-1].finish_reason == FinishReason.ERROR and "NaN" in outs["bad"][-1].error
    for i in range(2):
        got = [t for o in outs[f"good{i}"] for t in o.new_token_ids]
        assert got == clean[i] and outs[f"good{i}"][-1].finish_reason == FinishReason.LENGTH
    eng.check_integrity()

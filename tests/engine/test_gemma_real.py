"""The real default model, Gemma 3 270M, against transformers on the same dequantized weights (fp32)."""

from __future__ import annotations

import pytest
import torch

from edgeinfer.types import SamplingParams

pytestmark = pytest.mark.gemma

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
]


@pytest.fixture(scope="module")
def gemma_engine(default_gguf, engine_factory_module):
    return engine_factory_module(str(default_gguf), num_kv_blocks=64, block_size=16)


@pytest.fixture(scope="module")
def engine_factory_module():
    from engine.conftest import make_engine

    made = []

    def factory(model, **kw):
        made.append(make_engine(model, **kw))
        return made[-1]

    yield factory
    for eng in made:
        eng.check_integrity()
        assert eng.scheduler.kv.tables == {}


def test_greedy_continuations_match_transformers(gemma_engine, gemma_hf_fp32):
    tok = gemma_engine.tokenizer
    prompts = [tok.encode(p) for p in PROMPTS]
    assert all(p[0] == tok.bos_token_id for p in prompts)
    results = gemma_engine.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    for ids, res in zip(prompts, results, strict=True):
        with torch.no_grad():
            ref = gemma_hf_fp32.generate(
                torch.tensor([ids]), max_new_tokens=16, min_new_tokens=16, do_sample=False, pad_token_id=0
            )
        assert res.token_ids == ref[0, len(ids) :].tolist(), (
            res.text,
            tok.decode(ref[0, len(ids) :].tolist()),
        )
        assert res.text.strip()


def test_chat_format_produces_a_model_turn(gemma_engine):
    tok = gemma_engine.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "Say hello."}])
    assert text.endswith("<start_of_turn>model\n")
    ids = tok.encode(text, add_special_tokens=False)
    assert ids.count(tok.bos_token_id) == 1
    (res,) = gemma_engine.generate([ids], SamplingParams(max_tokens=24, temperature=0.0))
    assert res.token_ids and "<start_of_turn>" not in res.text

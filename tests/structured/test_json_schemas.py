"""Grammar-constrained decoding in the engine, on a tiny random model: every answer parses and validates.

A random model writes noise; only the grammar's token masks make its answers JSON, so these tests fail if a
mask is missing, misaligned with the vocabulary, applied to the wrong row of a batch, or undone by a later
sampling stage.
"""

from __future__ import annotations

import json
import math

import jsonschema
import pytest
from schemas import SCHEMAS

from edgeinfer.engine.engine import LLMEngine
from edgeinfer.engine.errors import EngineInputError
from edgeinfer.structured.grammar import json_schema_grammar
from edgeinfer.types import EngineRequest, FinishReason, SamplingParams

PROMPTS = ["Answer in JSON:", "The quick brown fox", "Edge inference", '{"name": "Ada"']
GRAMMARS = [json_schema_grammar(s) for s in SCHEMAS]


def _sampled(i: int, grammar: str | None) -> SamplingParams:
    """Random sampling with every option at once: temperature, top-k, top-p, min-p, penalties, logprobs."""
    return SamplingParams(
        max_tokens=64,
        temperature=0.9,
        top_k=40,
        top_p=0.95,
        min_p=0.01,
        repetition_penalty=1.1,
        presence_penalty=0.3,
        frequency_penalty=0.2,
        seed=1000 + i,
        logprobs=2,
        grammar=grammar,
    )


def test_schema_suite_greedy_and_sampled_batched_with_free_requests(json_engine: LLMEngine) -> None:
    assert len(SCHEMAS) >= 30
    greedy = [SamplingParams(max_tokens=64, temperature=0.0, grammar=g) for g in GRAMMARS]
    sampled = [_sampled(i, g) for i, g in enumerate(GRAMMARS)]
    free = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True), _sampled(99, None)]
    params = greedy + sampled + free
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(params))]
    results = json_engine.generate(prompts, params)
    for i, result in enumerate(results[: 2 * len(SCHEMAS)]):
        schema = SCHEMAS[i % len(SCHEMAS)]
        assert result.finish_reason == FinishReason.STOP, (i, result.text)
        jsonschema.validate(json.loads(result.text), schema)
    for result in results[len(SCHEMAS) : 2 * len(SCHEMAS)]:  # logprobs of the masked distribution
        assert all(math.isfinite(o.logprob) for out in result.outputs for o in out.logprobs)
    assert results[-2].finish_reason == FinishReason.LENGTH and len(results[-2].token_ids) == 24
    json_engine.check_integrity()


def test_constrained_rows_match_their_unbatched_runs(json_engine: LLMEngine) -> None:
    """A seeded constrained request gives the same tokens alone as amid other (free and constrained) rows."""
    picks = [0, 13, 27]
    alone = [json_engine.generate([PROMPTS[1]], _sampled(i, GRAMMARS[i]))[0].token_ids for i in picks]
    crowd = [_sampled(i, GRAMMARS[i]) for i in picks] + [_sampled(50, None), _sampled(51, GRAMMARS[5])]
    batched = json_engine.generate([PROMPTS[1]] * len(crowd), crowd)
    assert [r.token_ids for r in batched[: len(picks)]] == alone


def test_bad_grammar_is_refused_at_admission(json_engine: LLMEngine) -> None:
    request = EngineRequest(
        "bad-grammar", [1, 2, 3], SamplingParams(grammar='{"grammars": [{"lark_grammar": "x"}]}')
    )
    with pytest.raises(EngineInputError, match="grammar"):
        json_engine.add_request(request)
    assert not json_engine.has_unfinished_requests()


def test_a_failing_matcher_fails_only_its_request(json_engine: LLMEngine) -> None:
    ids = json_engine.tokenizer.encode(PROMPTS[0])
    grammar = GRAMMARS[0]
    for rid in ("victim", "bystander"):
        json_engine.add_request(
            EngineRequest(rid, ids, SamplingParams(max_tokens=64, temperature=0, grammar=grammar))
        )
    json_engine.add_request(EngineRequest("free", ids, SamplingParams(max_tokens=8, temperature=0)))
    # Put the victim's matcher in its error state, as a library failure would: feed it a token it forbids.
    matcher = json_engine.grammar._matchers["victim"]
    assert not matcher.consume_token(json_engine.tokenizer.encode("}", add_special_tokens=False)[0])
    finished = {}
    while json_engine.has_unfinished_requests():
        for out in json_engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert finished["victim"].finish_reason == FinishReason.ERROR and "grammar" in (
        finished["victim"].error or ""
    )
    assert finished["bystander"].finish_reason == FinishReason.STOP
    assert finished["free"].finish_reason == FinishReason.LENGTH
    json_engine.check_integrity()

"""llguidance's view of the vocabulary is built by the first constrained request, once per engine."""

from __future__ import annotations

import threading

from edgeinfer.engine.engine import LLMEngine
from edgeinfer.structured.grammar import json_schema_grammar
from edgeinfer.types import EngineRequest, SamplingParams


def _constrained(request_id: str) -> EngineRequest:
    grammar = json_schema_grammar({"type": "boolean"})
    return EngineRequest(
        request_id, [1, 2, 3], SamplingParams(max_tokens=4, temperature=0.0, grammar=grammar)
    )


def test_built_on_first_constrained_request_then_kept(json_engine: LLMEngine) -> None:
    lazy = json_engine.grammar._tokenizer
    assert lazy._result is None  # an engine that never sees a grammar never pays for it
    assert not any("llg" in t.name for t in threading.enumerate())

    json_engine.add_request(_constrained("a"))
    built = lazy.get()
    json_engine.add_request(_constrained("b"))
    assert lazy.get() is built
    while json_engine.has_unfinished_requests():
        json_engine.step()

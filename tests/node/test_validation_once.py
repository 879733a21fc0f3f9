"""Sampling bounds are written once (types/validation.py): the API schema, the body check and the engine's
SamplingParams agree on every bound and give one message."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from edgeinfer.api.schemas import CompletionRequest
from edgeinfer.types.sampling import SamplingParams
from edgeinfer.types.validation import SAMPLING_BOUNDS, Bound

# logprobs are capped by the server's own limit (NodeLimits.max_top_logprobs), not by the schema.
IN_SCHEMA = sorted(set(SAMPLING_BOUNDS) - {"logprobs", "prompt_logprobs"})


def _edges(bound: Bound) -> tuple[list[float], list[float]]:
    """Values on the bound that it admits, and values just past it that it does not."""
    step = 1 if bound.integer else 1e-6
    inside, outside = [], [bound.low - step]
    if bound.low_open:
        outside.append(bound.low)
        inside.append(bound.low + step)
    else:
        inside.append(bound.low)
    if bound.high is not None:
        inside.append(bound.high)
        outside.append(bound.high + step)
    return inside, outside


def _body_error(name: str, value: float) -> str | None:
    try:
        CompletionRequest.model_validate({"model": "m", "prompt": "x", name: value})
    except ValidationError as exc:
        return str(exc.errors()[0]["ctx"]["error"])
    return None


def _engine_error(name: str, value: float) -> str | None:
    try:
        SamplingParams(**{"max_tokens": 16, name: value})
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("name", IN_SCHEMA)
def test_schema_body_and_engine_agree_on_each_bound(name):
    bound = SAMPLING_BOUNDS[name]
    schema = CompletionRequest.model_json_schema()["properties"][name]
    declared = next((s for s in schema.get("anyOf", [schema]) if s.get("type") != "null"), schema)
    assert {k: declared[k] for k in bound.json_schema()} == bound.json_schema()
    inside, outside = _edges(bound)
    for value in inside:
        assert _body_error(name, value) is None and _engine_error(name, value) is None, value
    for value in outside:
        message = bound.message(name)
        assert _body_error(name, value) == message == _engine_error(name, value), value

"""What a request may hold, written once: the sampling fields' bounds and the checks of prompts and embedding
inputs against a model, each with the one message every layer gives.

`SamplingParams.validate` and the API schemas (api/schemas.py: pydantic bounds, so /openapi.json shows them)
both read `SAMPLING_BOUNDS`; the engine and the node (which checks before a stream starts, so that a bad
request gets a status rather than an error event) both call `check_prompt` and `check_embedding_inputs`.
Server limits (max_tokens caps, inputs per request) are the node's policy and stay there. Torch-free.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

MAX_LOGPROBS = 20
MAX_TOP_K = 2**31 - 1  # any k at or above the vocabulary size keeps every token
MAX_SEED = 2**64 - 1  # seeds are unsigned 64-bit (what torch.Generator.manual_seed takes)
# The largest token id a request may name (stop_token_ids): no vocabulary comes near it, and it keeps every
# id a 32-bit integer wherever it is stored. Ids inside it but outside a model's vocabulary never match.
MAX_TOKEN_ID = 2**31 - 1


class InvalidInput(ValueError):
    """A request no model setting can serve; `param` names the request field at fault."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Bound:
    """low <= value (low < value if `low_open`) and value <= high; `integer`: ints only (not bools)."""

    low: float
    high: float | None = None
    low_open: bool = False
    integer: bool = False

    def admits(self, value: Any) -> bool:
        if self.integer and (not isinstance(value, int) or isinstance(value, bool)):
            return False
        if not isinstance(value, int | float) or isinstance(value, bool):
            return False
        above = value > self.low if self.low_open else value >= self.low
        return above and (self.high is None or value <= self.high)

    def message(self, name: str) -> str:
        kind = "an integer" if self.integer else "a number"
        if self.high is None:
            return f"{name} must be {kind} {'>' if self.low_open else '>='} {_num(self.low)}"
        return f"{name} must be {kind} in {'(' if self.low_open else '['}{_num(self.low)}, {_num(self.high)}]"

    def json_schema(self) -> dict[str, float]:
        """The bound as JSON Schema keywords (for /openapi.json)."""
        limits: dict[str, float] = {"exclusiveMinimum" if self.low_open else "minimum": self.low}
        if self.high is not None:
            limits["maximum"] = self.high
        return limits


# SamplingParams field -> its bound; None is allowed where the field is optional (seed, logprobs).
SAMPLING_BOUNDS: dict[str, Bound] = {
    "max_tokens": Bound(1, integer=True),
    "temperature": Bound(0.0, 10.0),
    "top_k": Bound(-1, MAX_TOP_K, integer=True),  # 0 or -1: off
    "top_p": Bound(0.0, 1.0, low_open=True),
    "min_p": Bound(0.0, 1.0),
    "repetition_penalty": Bound(0.0, 10.0, low_open=True),
    "presence_penalty": Bound(-2.0, 2.0),
    "frequency_penalty": Bound(-2.0, 2.0),
    "seed": Bound(0, MAX_SEED, integer=True),
    "min_tokens": Bound(0, integer=True),
    "logprobs": Bound(0, MAX_LOGPROBS, integer=True),
    "prompt_logprobs": Bound(0, MAX_LOGPROBS, integer=True),
}


# Each id of stop_token_ids.
TOKEN_ID = Bound(0, MAX_TOKEN_ID, integer=True)


def _num(x: float) -> str:
    if x == MAX_SEED:
        return "2^64 - 1"
    return str(int(x)) if float(x).is_integer() else str(x)


def check_prompt(token_ids: Sequence[int], vocab_size: int, context_len: int) -> None:
    """A prompt the model can take: not empty, every id in its vocabulary, and room for one generated
    token in its context."""
    if not token_ids:
        raise InvalidInput("the prompt is empty", "prompt")
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidInput(f"prompt token id {bad} is outside the vocabulary [0, {vocab_size})", "prompt")
    if len(token_ids) >= context_len:
        raise InvalidInput(
            f"this model's maximum context length is {context_len} tokens; the prompt has "
            f"{len(token_ids)}, leaving no room for a generated token",
            "prompt",
        )


def check_some_inputs(inputs: Sequence[object], param: str = "input") -> None:
    """At least one input (checked on the body too, so that a router refuses it without a node)."""
    if not inputs:
        raise InvalidInput(f"`{param}` is an empty list; send at least one input", param)


def check_embedding_inputs(
    inputs: Sequence[Sequence[int]], vocab_size: int, max_length: int, param: str = "input"
) -> None:
    """Token-id inputs an encoder can embed: at least one, none empty, each within its maximum length
    (texts are truncated to it, so only token ids given as such can exceed it) and its vocabulary."""
    check_some_inputs(inputs, param)
    for i, ids in enumerate(inputs):
        if not ids:
            raise InvalidInput(f"`{param}[{i}]` is an empty list of token ids", param)
        if len(ids) > max_length:
            raise InvalidInput(
                f"`{param}[{i}]` has {len(ids)} tokens; this model's maximum input length is {max_length} "
                "tokens (texts are truncated to it; token ids must fit)",
                param,
            )
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise InvalidInput(
                f"`{param}[{i}]`: token id {bad} is outside the vocabulary [0, {vocab_size})", param
            )

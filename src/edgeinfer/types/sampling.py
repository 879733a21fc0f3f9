"""Sampling parameters of one request, validated where they enter the system (bounds: types/validation.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from edgeinfer.types.validation import MAX_SEED, SAMPLING_BOUNDS, TOKEN_ID, InvalidInput


@dataclass
class SamplingParams:
    """What to generate and how to pick each token.

    `top_k <= 0` and `top_p == 1` disable those filters; `temperature == 0` means greedy.
    `logprobs` asks for the top-N alternatives of every generated token (0: only the chosen one);
    `prompt_logprobs` does the same for every prompt token after the first.
    `grammar`: an llguidance grammar (serialized, as `edgeinfer.structured.grammar` builds it) that every
    sampled token must follow; the request finishes when the grammar is complete.
    `skip_special_tokens`: leave special tokens out of the text (tool-call markers need them kept).
    `speculative`: let the engine draft and verify several tokens per step where it speculates (the
    tokens are the same either way; False opts this request out, e.g. to measure it without).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    grammar: str | None = None
    skip_special_tokens: bool = True
    speculative: bool = True

    def __post_init__(self) -> None:
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        """Raise InvalidInput (a ValueError) with a one-line message naming the bad field."""
        for name, bound in SAMPLING_BOUNDS.items():
            value = getattr(self, name)
            if (value is not None or name not in _OPTIONAL) and not bound.admits(value):
                raise InvalidInput(bound.message(name), name)  # worded only when needed: every request checks
        _check(self.min_tokens <= self.max_tokens, "min_tokens must not exceed max_tokens", "min_tokens")
        _check(self.grammar is None or isinstance(self.grammar, str), "grammar must be a string", "grammar")
        stops_ok = all(isinstance(s, str) and s for s in self.stop)
        _check(stops_ok, "stop must be a list of non-empty strings", "stop")
        if not all(TOKEN_ID.admits(t) for t in self.stop_token_ids):
            raise InvalidInput(TOKEN_ID.message("every id in stop_token_ids"), "stop_token_ids")


_OPTIONAL = frozenset({"seed", "logprobs", "prompt_logprobs"})


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice `index` of an `n > 1` request: `seed + index`, wrapping within the seed range."""
    return None if seed is None else (seed + index) % (MAX_SEED + 1)


def _check(ok: bool, message: str, param: str) -> None:
    if not ok:
        raise InvalidInput(message, param)

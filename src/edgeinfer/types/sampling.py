"""Sampling parameters of one request, validated where they enter the system."""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_LOGPROBS = 20
MAX_TOP_K = 2**31 - 1  # any k at or above the vocabulary size keeps every token
MAX_SEED = 2**64 - 1  # seeds are unsigned 64-bit (what torch.Generator.manual_seed takes)


@dataclass
class SamplingParams:
    """What to generate and how to pick each token.

    `top_k <= 0` and `top_p == 1` disable those filters; `temperature == 0` means greedy.
    `logprobs` asks for the top-N alternatives of every generated token (0: only the chosen one);
    `prompt_logprobs` does the same for every prompt token after the first.
    `grammar`: an llguidance grammar (serialized, as `edgeinfer.structured.grammar` builds it) that every
    sampled token must follow; the request finishes when the grammar is complete.
    `skip_special_tokens`: leave special tokens out of the text (tool-call markers need them kept).
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

    def __post_init__(self) -> None:
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        """Raise ValueError with a one-line message naming the bad field."""
        _check(
            isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens must be an integer >= 1"
        )
        _check(0.0 <= self.temperature <= 10.0, "temperature must be in [0, 10]")
        _check(
            isinstance(self.top_k, int) and -1 <= self.top_k <= MAX_TOP_K,
            f"top_k must be an integer in [-1, {MAX_TOP_K}] (0 or -1: off)",
        )
        _check(0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]")
        _check(0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]")
        _check(0.0 < self.repetition_penalty <= 10.0, "repetition_penalty must be in (0, 10]")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty must be in [-2, 2]")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty must be in [-2, 2]")
        _check(
            self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed <= MAX_SEED),
            "seed must be an integer in [0, 2^64 - 1]",
        )
        _check(
            isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens must be an integer >= 0"
        )
        _check(self.min_tokens <= self.max_tokens, "min_tokens must not exceed max_tokens")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(
                value is None or (isinstance(value, int) and 0 <= value <= MAX_LOGPROBS),
                f"{name} must be an integer in [0, {MAX_LOGPROBS}]",
            )
        _check(self.grammar is None or isinstance(self.grammar, str), "grammar must be a string")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop must be a list of non-empty strings")
        _check(
            all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids must be ints >= 0",
        )


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice `index` of an `n > 1` request: `seed + index`, wrapping within the seed range."""
    return None if seed is None else (seed + index) % (MAX_SEED + 1)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)

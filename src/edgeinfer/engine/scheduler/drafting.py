"""Draft tokens for speculative decoding, proposed by the scheduler and verified by the runner.

A decoding request's next few tokens are guessed from its own context; the runner then computes the
request's last token and every drafted one in the same step (one decode row each) and keeps the longest
prefix of drafts that the model itself would have produced, plus the model's own next token
(runner/speculative.py). A wrong guess costs only the extra rows of that step.

`ngram` (prompt lookup, as vLLM's `[ngram]` and llama.cpp's `ngram-simple`): find the latest earlier
occurrence of the request's last n tokens (n from `ngram_max` down to `ngram_min`) in its prompt and output,
and propose the tokens that followed it. Copy-heavy work (extracting or rewriting a given text, code edits,
answers quoting their context, repeated passages) drafts long runs that are accepted whole.

`self` and `draft` (a draft model: the served model's own int4 form, or a separate small model of the same
vocabulary): the scheduler only reserves the drafts' places (`PENDING` tokens, with KV blocks for them);
the runner fills them with the draft model's greedy tokens before verifying (runner/draft.py).

No torch: proposals are plain lists of token ids.
"""

from __future__ import annotations

import sys
from abc import ABC, abstractmethod
from array import array
from dataclasses import dataclass

from edgeinfer.engine.scheduler.request import Request

_ITEM = 4  # bytes per token id in a request's search buffer (int32)
PENDING = -1  # a draft token the runner's draft model has yet to propose


@dataclass(frozen=True, kw_only=True)
class SpecConfig:
    """`method`: a name in DRAFTERS. `num_tokens`: drafts per request and step (at most). No request
    speculates in a step where more than `max_batch` requests decode: there every extra row costs the
    whole batch (the products are no longer bound by reading the weights once), and the batch already
    uses the hardware."""

    method: str = "ngram"
    num_tokens: int = 8
    ngram_min: int = 2
    ngram_max: int = 4
    max_batch: int = 4

    def __post_init__(self) -> None:
        if self.method not in DRAFTERS:
            raise ValueError(f"unknown speculative method {self.method!r} ({', '.join(DRAFTERS)})")
        if self.num_tokens < 1:
            raise ValueError("num_speculative_tokens must be >= 1")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError("ngram sizes must satisfy 1 <= ngram_min <= ngram_max")
        if self.max_batch < 1:
            raise ValueError("speculative max batch must be >= 1")


class Drafter(ABC):
    """Proposes draft tokens for a decoding request. `source` names it in the metrics.

    How many it is asked for follows how the request's last drafts fared: all of `num_tokens` at first and
    while drafts are accepted whole (twice the last length, at most that), one more than were accepted after
    a rejection. A request copying its context keeps long drafts; one whose guesses fail early costs few
    extra rows per step."""

    source: str
    in_runner = False  # a model in the runner proposes the drafts (ModelDrafter)

    def __init__(self, config: SpecConfig) -> None:
        self.config = config
        self._lengths: dict[str, int] = {}

    @abstractmethod
    def propose(self, req: Request, limit: int) -> list[int]:
        """Up to `limit` tokens likely to follow `req`'s tokens (possibly none)."""

    def length(self, request_id: str) -> int:
        """How many tokens to draft for the request in its next step."""
        return self._lengths.get(request_id, self.config.num_tokens)

    def observe(self, request_id: str, drafted: int, accepted: int) -> None:
        """The request's drafts were verified: `accepted` of `drafted` kept."""
        grown = min(self.config.num_tokens, 2 * drafted)
        self._lengths[request_id] = grown if accepted == drafted else accepted + 1

    def forget(self, request_id: str) -> None:
        """The request finished: drop whatever was kept for it."""
        self._lengths.pop(request_id, None)


class NgramDrafter(Drafter):
    """Prompt lookup. Each request's tokens are kept as int32 bytes, extended as its output grows, so a
    lookup is `bytearray.rfind` (a C scan) rather than a Python loop over the context."""

    source = "ngram"

    def __init__(self, config: SpecConfig) -> None:
        super().__init__(config)
        self.n_min, self.n_max = config.ngram_min, config.ngram_max
        self._buffers: dict[str, bytearray] = {}

    def propose(self, req: Request, limit: int) -> list[int]:
        if limit <= 0:
            return []
        buf = self._synced(req)
        tokens = len(buf) // _ITEM
        for n in range(min(self.n_max, tokens - 1), self.n_min - 1, -1):
            start = _latest_earlier(buf, n)
            if start is not None:
                follow = _ids(buf[(start + n) * _ITEM : (start + n + limit) * _ITEM])
                # A match close to the end (a repeating pattern) leaves fewer tokens after it than asked
                # for; what follows is then the pattern again, its period the distance between the two
                # occurrences.
                period = tokens - n - start
                while len(follow) < limit:
                    follow.append(follow[len(follow) - period])
                return follow
        return []

    def forget(self, request_id: str) -> None:
        super().forget(request_id)
        self._buffers.pop(request_id, None)

    def _synced(self, req: Request) -> bytearray:
        """The request's tokens so far: its prompt once, then whatever output came since the last call.
        Outputs only grow while a request runs (a stop that cuts them also finishes it)."""
        buf = self._buffers.get(req.request_id)
        if buf is None:
            buf = self._buffers[req.request_id] = bytearray(_raw(req.prompt_token_ids))
        have = len(buf) // _ITEM - req.num_prompt_tokens
        if have < len(req.output_token_ids):
            buf += _raw(req.output_token_ids[have:])
        return buf


def _latest_earlier(buf: bytearray, n: int) -> int | None:
    """Token index of the latest occurrence of the last `n` tokens that ends before the last token."""
    needle = bytes(buf[-n * _ITEM :])
    end = len(buf) - _ITEM
    while True:
        at = buf.rfind(needle, 0, end)
        if at < 0:
            return None
        if at % _ITEM == 0:
            return at // _ITEM
        end = at + len(needle) - 1  # a match across token boundaries: look before it


def _raw(ids: list[int]) -> bytes:
    data = array("i", ids)
    if sys.byteorder != "little":
        data.byteswap()
    return data.tobytes()


def _ids(raw: bytes | bytearray) -> list[int]:
    data = array("i")
    data.frombytes(bytes(raw))
    if sys.byteorder != "little":
        data.byteswap()
    return data.tolist()


class ModelDrafter(Drafter):
    """Drafts by a model that runs in the runner: proposes `limit` places for it to fill. Its proposals
    are greedy, so one-hot, and the verification rule keeps the output exact at any temperature."""

    source = "draft"
    in_runner = True

    def propose(self, req: Request, limit: int) -> list[int]:
        return [PENDING] * max(limit, 0)


class SelfDrafter(ModelDrafter):
    """The served model's own int4 form drafts (self-speculation)."""

    source = "self"


DRAFTERS: dict[str, type[Drafter]] = {"ngram": NgramDrafter, "self": SelfDrafter, "draft": ModelDrafter}
MODEL_DRAFTERS = ("self", "draft")  # methods whose drafts a model in the runner proposes


def make_drafter(config: SpecConfig | None) -> Drafter | None:
    """The drafter `config` names; None (no speculation) without one."""
    return DRAFTERS[config.method](config) if config is not None else None

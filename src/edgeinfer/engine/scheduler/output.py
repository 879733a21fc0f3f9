"""Plain data passed from the scheduler to the runner."""

from __future__ import annotations

from dataclasses import dataclass, field

from edgeinfer.types import SamplingParams


@dataclass
class ScheduledChunk:
    """Compute KV for `token_ids` at positions [start, start + len) of one request.

    `sample`: this chunk reaches the request's last known token, so the runner samples a next token.
    `draft_token_ids` (speculative decoding, scheduler/drafting.py): guesses of the tokens after the
    request's last one, appended to `token_ids` (whose first token is then the request's last known one);
    the runner verifies them in this step and returns the accepted ones and the model's next token.
    With `sampling.prompt_logprobs` set, the runner also scores the chunk's prompt rows: row p gives the
    logprob of prompt token p + 1. `block_ids`: the request's block table in each KV group
    (kv_cache/groups.py)."""

    request_id: str
    token_ids: list[int]
    start: int
    block_ids: list[list[int]]
    sample: bool
    sampling: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    num_prompt_tokens: int
    eos_token_ids: frozenset[int] = frozenset()
    draft_token_ids: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def is_decode(self) -> bool:
        """One known token to compute (a plain decode, or one verifying its drafts): each of its tokens
        runs as a decode row, never as a prefill chunk."""
        return self.num_tokens == 1 + len(self.draft_token_ids)


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    # of `preempted`, the batch requests that gave their seat or blocks to an interactive one (admission
    # goes on after those; after a preemption for lack of blocks it waits for the next step)
    yielded: int = 0
    finished: list[str] = field(default_factory=list)  # requests the runner may forget (generators, ...)
    # batch-lane work only: interactive work arriving meanwhile may stop the step (runner/interrupt.py)
    interruptible: bool = False
    # speculation is on and no more requests run than may speculate (runner/draft.py prefills for them)
    few_running: bool = False

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def num_draft_tokens(self) -> int:
        return sum(len(c.draft_token_ids) for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks

"""Drafts by a model (`self`: the served model's int4 form; `draft`: a separate small model of the same
vocabulary), proposed in the runner just before the step verifies them (runner/speculative.py).

The scheduler reserves a decoding request's draft places (`drafting.PENDING`, with KV blocks for them);
here the draft model decodes greedily from the request's last token, one row per request and step, k
steps for k drafts (the fused decode step where it takes the model), and the drafts take their places.
Greedy drafts are one-hot, so the verification keeps the output exact at any temperature.

The draft's KV lives in storage of its own, laid out as the target's: the same blocks, block size, block
tables and slot mappings, with the draft's own layer and head shapes. Admission, preemption, prefix caching
and rollback then need no bookkeeping of their own: a position past the accepted ones is overwritten later,
as the target's is. The draft computes what it needs lazily. While few requests run (no more than may
speculate), it prefills every prompt chunk the target prefills, in the same step, so a prefix-cache hit on a
prompt finds the draft's KV of those blocks too; while many run, none drafts and it prefills nothing. At a
request's first draft step it computes whatever positions it has not computed (a prompt prefilled while
many ran, decode steps without drafts, the last token of a run accepted whole): as decode rows where they are
few, else as one causal chunk. Draft KV that is missing or stale (a cached block written while the draft
was not prefilling) only lowers the acceptance rate: the target's verification decides every token.
"""

from __future__ import annotations

import dataclasses

import torch

from edgeinfer.engine.kv_cache import NULL_BLOCK
from edgeinfer.engine.runner.draft_head import DraftHead
from edgeinfer.engine.runner.inputs import build_inputs
from edgeinfer.engine.runner.runner import ModelRunner
from edgeinfer.engine.scheduler import ScheduledChunk
from edgeinfer.engine.scheduler.drafting import PENDING

_DECODE_ROWS = 4  # the most positions a catch-up computes as decode rows of their own


class DraftRunner:
    """Fills the pending drafts of a step's chunks with the draft model's greedy tokens."""

    def __init__(self, runner: ModelRunner, head: DraftHead) -> None:
        self.runner = runner  # the draft model over its own KV storage
        self.head = head
        self._computed: dict[str, int] = {}  # per request: draft KV written for positions [0, n)

    def forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._computed.pop(rid, None)

    @torch.inference_mode()
    def fill(self, chunks: list[ScheduledChunk], prefill: bool = True) -> list[ScheduledChunk]:
        """`chunks` with every pending draft proposed; with `prefill`, their prompt chunks prefilled into
        the draft's KV (without, as while many requests run and none drafts, a request's first draft
        catches up on its context)."""
        drafting = [c for c in chunks if c.draft_token_ids and c.draft_token_ids[0] == PENDING]
        prefills = [dataclasses.replace(c, sample=False) for c in chunks if not c.is_decode and prefill]
        if not drafting and not prefills:
            return chunks
        first = self._step([self._catch_up(c) for c in drafting] + prefills)
        for c in prefills:
            # a first chunk past the start is a prefix-cache hit: blocks a prompt prefill wrote, draft too
            if self._computed.get(c.request_id, c.start) >= c.start:
                self._computed[c.request_id] = c.start + c.num_tokens
        drafts = {c.request_id: [t] for c, t in zip(drafting, first, strict=True)}
        for j in range(1, max((len(c.draft_token_ids) for c in drafting), default=0)):
            live = [c for c in drafting if len(c.draft_token_ids) > j]
            rows = [_row(c, drafts[c.request_id][-1], c.start + j) for c in live]
            for c, token in zip(live, self._step(rows), strict=True):
                drafts[c.request_id].append(token)
        for c in drafting:  # its last token and all its drafts but the last went through the draft
            self._computed[c.request_id] = c.start + len(c.draft_token_ids)
        return [_filled(c, drafts[c.request_id]) if c.request_id in drafts else c for c in chunks]

    def _step(self, chunks: list[ScheduledChunk]) -> list[int]:
        """One forward of the draft model; the greedy next token of each sampling chunk, in order."""
        inp = build_inputs(chunks, self.runner.storage.block_size, self.runner.device)
        hidden = self.runner.forward(inp)
        if not inp.groups:
            return []
        last = {g.chunk.request_id: inp.sample_rows[g.first + g.size - 1] for g in inp.groups}
        return self.head(hidden[[last[c.request_id] for c in chunks if c.sample]])

    def _catch_up(self, c: ScheduledChunk) -> ScheduledChunk:
        """The first draft step's chunk for `c`: every position from the first the draft has not computed
        (among those whose blocks the request still holds in every KV group) to its last token."""
        held = _first_held(c) * self.runner.storage.block_size
        start = max(min(self._computed.get(c.request_id, 0), c.start), held)
        ids = (c.prompt_token_ids + c.output_token_ids)[start : c.start + 1]
        # A few missed positions (the last of a run accepted whole) go as decode rows, so the step stays
        # in the fused decode path; a longer run as one causal chunk.
        behind = ids[1:] if len(ids) <= _DECODE_ROWS else []
        return dataclasses.replace(c, token_ids=ids, start=start, sample=True, draft_token_ids=behind)


def _first_held(c: ScheduledChunk) -> int:
    """The first block the request holds in every KV group (windowed groups give back the blocks their
    window left): positions before it have nowhere to be written."""
    return max(next((i for i, b in enumerate(t) if b != NULL_BLOCK), len(t)) for t in c.block_ids)


def _row(c: ScheduledChunk, token: int, position: int) -> ScheduledChunk:
    return dataclasses.replace(c, token_ids=[token], start=position, sample=True, draft_token_ids=[])


def _filled(c: ScheduledChunk, drafts: list[int]) -> ScheduledChunk:
    return dataclasses.replace(c, token_ids=c.token_ids[:1] + drafts, draft_token_ids=drafts)

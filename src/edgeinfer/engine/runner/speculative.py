"""Verifying draft tokens (scheduler/drafting.py) against the model's own choices.

A verifying chunk computes its last known token and its k drafts as k + 1 decode rows, and the sampler
picks a token at every row as it would for a plain decode of that position (row j sees the first j
drafts as already generated: penalties, grammar state, a seeded request's draw). The kept tokens are
the row tokens up to and including the first that differs from the draft it checks, or all k + 1.

Greedy: row j's token is the argmax after drafts[:j], so the kept tokens are exactly those that decoding
one token per step produces. Sampling: row j's token is drawn from the model's distribution p_j (after
temperature, top-k/p, min-p, penalties and the grammar mask), and draft j + 1 is kept iff the drawn token
equals it. For a draft that is one fixed token d (q = one-hot(d)), that is speculative sampling's rule:
d is accepted with probability min(1, p(d) / q(d)) = p(d), and on rejection the emitted token follows
max(0, p - q) renormalised, which is p without d: P(emit x) = p(x) for every x either way. So the output
has the distribution of plain sampling, and with a seed the very same tokens (each output position takes
the same draw of the request's generator as without speculation: sampler.py).
"""

from __future__ import annotations

from edgeinfer.engine.runner.inputs import SampleGroup
from edgeinfer.types import TokenLogprob


def kept_tokens(drafts: list[int], row_tokens: list[int]) -> int:
    """How many of the rows' tokens are emitted: up to the first row whose token is not the next draft."""
    for j, draft in enumerate(drafts):
        if row_tokens[j] != draft:
            return j + 1
    return len(row_tokens)


def per_request(
    groups: list[SampleGroup], rows: list[int], row_logprobs: list[TokenLogprob | None], failed: set[str]
) -> tuple[dict[str, list[int]], dict[str, list[TokenLogprob]]]:
    """Each sampling request's emitted tokens and their logprobs (where asked), from every row's."""
    tokens: dict[str, list[int]] = {}
    logprobs: dict[str, list[TokenLogprob]] = {}
    for g in groups:
        rid = g.chunk.request_id
        if rid in failed:
            continue
        mine = rows[g.first : g.first + g.size]
        n = kept_tokens(g.chunk.draft_token_ids, mine)
        tokens[rid] = mine[:n]
        lps = [lp for lp in row_logprobs[g.first : g.first + n] if lp is not None]
        if lps:
            logprobs[rid] = lps
    return tokens, logprobs

"""Turning fp32 logits into tokens: penalties, temperature, top-k/top-p/min-p, seeds, logprobs.

Greedy rows take one batched argmax. Random rows sample by inverting the CDF: one uniform draw per row from
the request's own generator (so a seeded request's tokens do not depend on what else is in the batch), located
in the row's cumulative probabilities. The exponential race (argmax of p / E, E ~ Exp(1)) would draw one
random number per vocabulary entry, a large share of a batched decode step on a big vocabulary; the CDF costs
one pass of block sums plus two short cumulative sums.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from edgeinfer.engine.runner.grammar import StepMasks, apply_masks
from edgeinfer.engine.scheduler import ScheduledChunk
from edgeinfer.types import TokenLogprob


@dataclass
class SampleResult:
    """Per request: its token, logprob, or why it failed (a request with several rows, one verifying drafts:
    its last row's, see `rows`). `rows` and `row_logprobs`: every row's, in row order."""

    tokens: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    rows: list[int] = field(default_factory=list)
    row_logprobs: list[TokenLogprob | None] = field(default_factory=list)


def top_logprobs(logprobs: torch.Tensor, chosen: torch.Tensor, n: int) -> list[TokenLogprob]:
    """Per row: the chosen token's logprob and the top-n alternatives."""
    picked = logprobs.gather(-1, chosen.unsqueeze(-1)).squeeze(-1).tolist()
    ids = chosen.tolist()
    if n == 0:
        return [TokenLogprob(i, lp) for i, lp in zip(ids, picked, strict=True)]
    vals, idx = logprobs.topk(n, dim=-1)
    return [
        TokenLogprob(i, lp, list(zip(ti, tv, strict=True)))
        for i, lp, ti, tv in zip(ids, picked, idx.tolist(), vals.tolist(), strict=True)
    ]


class Sampler:
    """`vocab_limit`: ids at and above it are never sampled (checkpoints often pad the embedding matrix
    beyond the tokenizer's vocabulary; those rows are untrained and have no text)."""

    def __init__(self, vocab_limit: int | None = None) -> None:
        self._generators: dict[str, torch.Generator] = {}
        # a seeded request's recent draws: (position of the first, draws of it and the positions after)
        self._draws: dict[str, tuple[int, list[torch.Tensor]]] = {}
        self.vocab_limit = vocab_limit

    def forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._generators.pop(rid, None)
            self._draws.pop(rid, None)

    def sample(
        self, logits: torch.Tensor, chunks: list[ScheduledChunk], masks: StepMasks | None = None
    ) -> SampleResult:
        """Tokens for every row. Grammar `masks` restrict their rows before anything else, so penalties,
        temperature, top-k/p, seeds and logprobs all see only the tokens the grammar allows."""
        result = SampleResult()
        # One reduction per row: any NaN or ±Inf makes the row sum non-finite (fp32 logits cannot reach Inf).
        finite = torch.isfinite(logits.sum(dim=-1)).tolist()
        for ok, c in zip(finite, chunks, strict=True):
            if not ok:
                result.errors[c.request_id] = "the model produced NaN or Inf logits"
        if self.vocab_limit is not None and self.vocab_limit < logits.shape[-1]:
            logits = logits.clone()
            logits[:, self.vocab_limit :] = float("-inf")
        if masks is not None:  # in place: the runner's logits buffer is rewritten every step anyway
            apply_masks(logits, masks)
            result.errors.update(masks.errors)
        raw = logits
        if any(_needs_penalties(c) for c in chunks):  # copy only when logits will be edited
            logits = self._apply_penalties(logits.clone(), chunks)
        greedy = torch.tensor([c.sampling.greedy for c in chunks], device=logits.device)
        if not bool(greedy.any()):  # all random: no argmax, no copy of the rows
            chosen = self._sample_random(logits, chunks)
        else:
            chosen = greedy_argmax(logits)
            if not bool(greedy.all()):
                rows = (~greedy).nonzero().squeeze(-1)
                chosen[rows] = self._sample_random(logits[rows], [chunks[i] for i in rows.tolist()])
        result.row_logprobs = [None] * len(chunks)
        want = [i for i, c in enumerate(chunks) if c.sampling.logprobs is not None]
        if want:
            lp = torch.log_softmax(raw[want], dim=-1)
            n = max(chunks[i].sampling.logprobs for i in want)
            for i, tlp in zip(want, top_logprobs(lp, chosen[want], n), strict=True):
                tlp.top = tlp.top[: chunks[i].sampling.logprobs]
                result.logprobs[chunks[i].request_id] = tlp
                result.row_logprobs[i] = tlp
        result.rows = chosen.tolist()
        for c, tok in zip(chunks, result.rows, strict=True):
            if c.request_id not in result.errors:
                result.tokens[c.request_id] = tok
        return result

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, chunks: list[ScheduledChunk]) -> torch.Tensor:
        for i, c in enumerate(chunks):
            s = c.sampling
            row = logits[i]
            if len(c.output_token_ids) < s.min_tokens:
                banned = [t for t in (*s.stop_token_ids, *c.eos_token_ids) if t < row.shape[0]]
                row[banned] = float("-inf")
            if s.repetition_penalty != 1.0:
                seen = torch.tensor(
                    sorted(set(c.prompt_token_ids) | set(c.output_token_ids)), device=row.device
                )
                vals = row[seen]
                row[seen] = torch.where(vals > 0, vals / s.repetition_penalty, vals * s.repetition_penalty)
            if (s.presence_penalty or s.frequency_penalty) and c.output_token_ids:
                out = torch.tensor(c.output_token_ids, device=row.device)
                counts = torch.bincount(out, minlength=row.shape[0]).to(row.dtype)
                row -= counts * s.frequency_penalty + (counts > 0).to(row.dtype) * s.presence_penalty
        return logits

    def _sample_random(self, logits: torch.Tensor, chunks: list[ScheduledChunk]) -> torch.Tensor:
        temps = torch.tensor([c.sampling.temperature for c in chunks], device=logits.device).unsqueeze(-1)
        logits = logits / temps
        top_k = [c.sampling.top_k for c in chunks]
        if any(k > 0 for k in top_k):
            k_max = min(max(top_k), logits.shape[-1])
            kth_vals = logits.topk(k_max, dim=-1).values
            ks = torch.tensor([(k if k > 0 else k_max) - 1 for k in top_k], device=logits.device)
            kth = kth_vals.gather(-1, ks.clamp(max=k_max - 1).unsqueeze(-1))
            off = torch.tensor([k <= 0 for k in top_k], device=logits.device).unsqueeze(-1)
            logits = logits.masked_fill((logits < kth) & ~off, float("-inf"))
        probs = logits.softmax(dim=-1)
        top_p = torch.tensor([c.sampling.top_p for c in chunks], device=logits.device)
        if bool((top_p < 1.0).any()):
            probs = _top_p(probs, top_p)
        min_p = torch.tensor([c.sampling.min_p for c in chunks], device=logits.device)
        if bool((min_p > 0).any()):
            probs = probs.masked_fill(probs < min_p.unsqueeze(-1) * probs.amax(-1, keepdim=True), 0.0)
        u = torch.stack([self._uniform(c, probs.device) for c in chunks])
        return inverse_cdf(probs, u)

    def _uniform(self, chunk: ScheduledChunk, device: torch.device) -> torch.Tensor:
        """The row's draw. A seeded request's generator gives its i-th draw to output position i, whatever
        step samples that position: when a step is redone without a request that made it fail, the others
        reuse their draws and get the tokens of a run without it; and rows verifying drafts past the first
        rejected one draw for positions sampled again in a later step, which then reuses those draws, so
        speculation leaves a seeded request's tokens as they are without it."""
        gen = self._generator(chunk, device)
        if gen is None:
            return torch.rand((), device=device)
        position = len(chunk.output_token_ids)
        first, draws = self._draws.get(chunk.request_id, (position, []))
        if position < first:  # never sampled below the oldest kept draw; a fresh run of positions
            first, draws = position, []
        while first + len(draws) <= position:
            draws.append(torch.rand((), generator=gen, device=device))
        # keep a few positions back: a redone step samples its positions again
        drop = max(0, position - first - _KEEP_DRAWS)
        self._draws[chunk.request_id] = (first + drop, draws[drop:])
        return draws[position - first]

    def _generator(self, chunk: ScheduledChunk, device: torch.device) -> torch.Generator | None:
        seed = chunk.sampling.seed
        if seed is None:
            return None
        gen = self._generators.get(chunk.request_id)
        if gen is None:
            gen = torch.Generator(device=device).manual_seed(seed)
            self._generators[chunk.request_id] = gen
        return gen


# Draws kept below the latest position sampled (a redone step asks again for at most its drafts' count).
_KEEP_DRAWS = 64


def greedy_argmax(logits: torch.Tensor, width: int = 1024) -> torch.Tensor:
    """`logits.argmax(-1)` (the first index of each row's maximum), in two vectorised passes.

    torch's CPU argmax over a long last dimension runs several times slower than `amax` (a vocabulary-wide row
    of logits is such a dimension): block maxima pick the first block holding the row maximum, then one argmax
    inside that block. A NaN is the maximum in both passes, as in `argmax`.
    """
    rows, vocab = logits.shape
    pad = (-vocab) % width
    blocks = (F.pad(logits, (0, pad), value=float("-inf")) if pad else logits).reshape(rows, -1, width)
    b = blocks.amax(-1).argmax(-1)
    return b * width + blocks[torch.arange(rows, device=logits.device), b].argmax(-1)


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor, width: int = 1024) -> torch.Tensor:
    """Per row, the first index whose cumulative probability exceeds `u * total` (`u` in [0, 1)).

    Two levels, in fp64 (a 262k-term fp32 running sum could drift past the smallest probabilities):
    cumulative block masses pick a block, a cumulative sum inside that block picks the entry. The entry
    found always has probability > 0.
    """
    rows, vocab = probs.shape
    blocks = F.pad(probs, (0, (-vocab) % width)).view(rows, -1, width)
    cdf = blocks.sum(-1, dtype=torch.float64).cumsum(-1)  # [rows, blocks]
    target = u.double() * cdf[:, -1]
    b = torch.searchsorted(cdf, target[:, None], right=True).squeeze(-1).clamp_(max=cdf.shape[-1] - 1)
    before = torch.where(b > 0, cdf.gather(-1, (b - 1).clamp(min=0)[:, None]).squeeze(-1), 0.0)
    inner = blocks[torch.arange(rows, device=probs.device), b].double().cumsum(-1)  # [rows, width]
    # the block holds mass > target - before; keep the target strictly inside it despite rounding
    rest = torch.minimum(target - before, inner[:, -1] * (1 - 2**-40))
    j = torch.searchsorted(inner, rest[:, None], right=True).squeeze(-1)
    # only a NaN row (already failed by `sample`) can land past the end; keep its index gatherable
    return (b * width + j).clamp_(max=vocab - 1)


def _needs_penalties(c: ScheduledChunk) -> bool:
    s = c.sampling
    return (
        len(c.output_token_ids) < s.min_tokens
        or s.repetition_penalty != 1.0
        or s.presence_penalty != 0.0
        or s.frequency_penalty != 0.0
    )


def _top_p(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of tokens whose mass reaches top_p (always at least the top one)."""
    sorted_p, idx = probs.sort(dim=-1, descending=True)
    mass_before = sorted_p.cumsum(-1) - sorted_p
    sorted_p = sorted_p.masked_fill(mass_before >= top_p.unsqueeze(-1), 0.0)
    return torch.zeros_like(probs).scatter_(-1, idx, sorted_p)

"""Teacher-forced scoring of a reference model and candidates on the same token stream.

Each window runs as one prefill through the engine's own model, attention backend and paged KV storage
(with the candidate's `kv_cache_dtype`: a quantized cache is written and read back inside attention, so
KV quantization shows in the numbers). Full next-token distributions are compared row chunk by row chunk,
so the [tokens × vocabulary] log-probabilities (fp32: 1 MiB a token for Gemma's 262k entries) never exist
all at once.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from edgeinfer.engine.attention.oneshot import prefill_hidden
from edgeinfer.eval.metrics import (
    kl_divergence,
    perplexity,
    perplexity_change,
    quantile,
    token_nll,
    top1_agreement,
)

log = logging.getLogger(__name__)

LOGIT_ROWS = 32  # rows of [rows, vocab] fp32 log-probabilities held at once per model (32 MiB for Gemma)


@dataclass(frozen=True)
class Window:
    """Tokens `[begin, end)` of the stream are fed; targets `[first_scored, end)` are scored."""

    begin: int
    end: int
    first_scored: int


def plan_windows(num_tokens: int, window: int, stride: int, first_scored: int = 0) -> list[Window]:
    """Sliding windows of `window` tokens, `stride` apart; every target from `first_scored` on is scored
    exactly once, in the first window that contains it (so later windows give it `window - stride` tokens
    of context or more)."""
    if window < 1 or not 1 <= stride <= window:
        raise ValueError(f"need window >= 1 and 1 <= stride <= window, got window {window}, stride {stride}")
    if num_tokens <= first_scored:
        raise ValueError(f"nothing to score: {num_tokens} tokens")
    windows, begin, scored = [], 0, first_scored
    while True:
        end = min(begin + window, num_tokens)
        windows.append(Window(begin, end, scored))
        if end == num_tokens:
            return windows
        scored, begin = end, begin + stride


@dataclass(frozen=True)
class Candidate:
    """One model to score: its weights (quantized or not) and the KV-cache dtype its attention uses."""

    name: str
    model: nn.Module
    kv_cache_dtype: str = "auto"
    dtype: torch.dtype = torch.bfloat16
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def key(self) -> tuple[int, str]:
        """Equal keys compute equal logits: the same model object with the same KV dtype."""
        return id(self.model), self.kv_cache_dtype

    @classmethod
    def from_engine(cls, name: str, engine, kv_cache_dtype: str | None = None) -> Candidate:
        """The model of a built `LLMEngine`, with its KV dtype unless another is given."""
        kv = kv_cache_dtype or engine.config.kv_cache_dtype
        return cls(name, engine.model, kv, engine.layout.dtype, engine.device)


@torch.inference_mode()
def forward_hidden(candidate: Candidate, input_ids: Sequence[int]) -> torch.Tensor:
    """Final hidden states [T, H] of one sequence prefilled in one step through a fresh paged cache."""
    c = candidate
    return prefill_hidden(c.model, input_ids, c.dtype, c.device, c.kv_cache_dtype)


@dataclass
class TokenScores:
    """Per scored token: the candidate's NLL, KL(reference || candidate) and top-1 agreement."""

    nll: list[torch.Tensor] = field(default_factory=list)
    kl: list[torch.Tensor] = field(default_factory=list)
    agree: list[torch.Tensor] = field(default_factory=list)

    def summary(self, reference_nll: torch.Tensor) -> Comparison:
        nll, kl, agree = torch.cat(self.nll), torch.cat(self.kl), torch.cat(self.agree)
        change, ci95 = perplexity_change(nll, reference_nll)
        return Comparison(
            tokens=nll.numel(),
            perplexity=perplexity(nll),
            ppl_change=change,
            ppl_change_ci95=ci95,
            kl_mean=kl.mean().item(),
            kl_p99=quantile(kl, 0.99),
            kl_max=kl.max().item(),
            top1_agreement=agree.float().mean().item(),
        )


@dataclass(frozen=True)
class Comparison:
    """A candidate against the reference on the same scored tokens (KL in nats)."""

    tokens: int
    perplexity: float
    ppl_change: float  # relative: 0.01 is +1 %
    ppl_change_ci95: float  # half-width of its 95 % confidence interval, same units
    kl_mean: float
    kl_p99: float
    kl_max: float
    top1_agreement: float


@dataclass
class ScoreResult:
    reference_nll: torch.Tensor
    scores: dict[str, TokenScores]

    @property
    def reference_perplexity(self) -> float:
        return perplexity(self.reference_nll)

    def comparisons(self) -> dict[str, Comparison]:
        return {name: s.summary(self.reference_nll) for name, s in self.scores.items()}


def _logprobs(candidate: Candidate, hidden: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return torch.log_softmax(candidate.model.compute_logits(hidden).float(), dim=-1)


def compare(
    reference: Candidate,
    candidates: Sequence[Candidate],
    token_ids: Sequence[int],
    bos_token_id: int | None,
    window: int,
    stride: int,
) -> ScoreResult:
    """Score every token of `token_ids` under the reference and each candidate (names must differ).

    Each window is fed as `[BOS] + tokens` when the tokenizer has a BOS (Gemma needs it), and then the
    first token is scored too; without one the first token has no prediction and is skipped.
    """
    names = [c.name for c in candidates]
    if len(set(names)) != len(names):
        raise ValueError(f"candidate names must be unique, got {names}")
    prefix = [] if bos_token_id is None else [bos_token_id]
    plan = plan_windows(len(token_ids), window, stride, first_scored=0 if prefix else 1)
    ref_nll: list[torch.Tensor] = []
    scores = {c.name: TokenScores() for c in candidates}
    for i, w in enumerate(plan):
        log.info(
            "window %d/%d: tokens %d..%d, scoring from %d", i + 1, len(plan), w.begin, w.end, w.first_scored
        )
        fed = prefix + list(token_ids[w.begin : w.end])
        hidden: dict[tuple[int, str], torch.Tensor] = {}
        for c in (reference, *candidates):
            if c.key not in hidden:
                hidden[c.key] = forward_hidden(c, fed)
        # The row predicting token j is the one just before j's input position.
        first_row = w.first_scored - w.begin + len(prefix) - 1
        targets = torch.tensor(list(token_ids[w.first_scored : w.end]), device=reference.device)
        for start in range(0, len(targets), LOGIT_ROWS):
            rows = slice(first_row + start, first_row + min(start + LOGIT_ROWS, len(targets)))
            tgt = targets[start : start + LOGIT_ROWS]
            ref_lp = _logprobs(reference, hidden[reference.key][rows])
            ref_nll.append(token_nll(ref_lp, tgt))
            for c in candidates:
                lp = ref_lp if c.key == reference.key else _logprobs(c, hidden[c.key][rows])
                s = scores[c.name]
                s.nll.append(token_nll(lp, tgt))
                s.kl.append(kl_divergence(ref_lp, lp))
                s.agree.append(top1_agreement(ref_lp, lp))
    return ScoreResult(torch.cat(ref_nll), scores)

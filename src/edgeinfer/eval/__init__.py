"""Accuracy harness: perplexity on held-out English text, and KL divergence, top-1 agreement and greedy
match length of a quantized configuration against the unquantized baseline (`edgeinfer eval`).
docs/quantization.md describes the method and the text."""

from edgeinfer.eval.harness import DEFAULT_TEXT
from edgeinfer.eval.metrics import greedy_match_length, kl_divergence, perplexity, token_nll, top1_agreement
from edgeinfer.eval.scoring import Candidate, Comparison, ScoreResult, compare, plan_windows

__all__ = [
    "DEFAULT_TEXT",
    "Candidate",
    "Comparison",
    "ScoreResult",
    "compare",
    "greedy_match_length",
    "kl_divergence",
    "perplexity",
    "plan_windows",
    "token_nll",
    "top1_agreement",
]

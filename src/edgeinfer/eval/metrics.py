"""The accuracy metrics, on plain tensors: per-position NLL, KL divergence, top-1 agreement, perplexity,
greedy match length. Rows are positions, columns the vocabulary; inputs are natural-log probabilities."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def token_nll(logprobs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """[N, V] log-probabilities, [N] target ids → [N] negative log-likelihood of each target (fp32)."""
    return -logprobs.float().gather(-1, targets.view(-1, 1)).squeeze(-1)


def kl_divergence(ref_logprobs: torch.Tensor, test_logprobs: torch.Tensor) -> torch.Tensor:
    """KL(P_ref || P_test) per row, in nats: Σ_v p_ref(v) (log p_ref(v) - log p_test(v)).

    The reference is the first argument (the unquantized model), as llama.cpp's KL statistics use it.
    Tokens the reference gives probability 0 contribute 0 (0 · log 0 = 0); tokens the test model gives
    probability 0 where the reference does not make the divergence infinite, as the definition says.
    """
    ref, test = ref_logprobs.float(), test_logprobs.float()
    p = ref.exp()
    terms = torch.where(p > 0, p * (ref - test), torch.zeros((), dtype=ref.dtype, device=ref.device))
    return terms.sum(-1)


def top1_agreement(ref_logprobs: torch.Tensor, test_logprobs: torch.Tensor) -> torch.Tensor:
    """[N] bool: whether both distributions put their highest probability on the same token."""
    return ref_logprobs.argmax(-1) == test_logprobs.argmax(-1)


def perplexity(nll: Sequence[float] | torch.Tensor) -> float:
    """exp(mean NLL): the perplexity of the scored tokens."""
    values = torch.as_tensor(nll, dtype=torch.float64)
    if values.numel() == 0:
        raise ValueError("perplexity needs at least one scored token")
    return math.exp(values.mean().item())


def perplexity_change(test_nll: torch.Tensor, ref_nll: torch.Tensor) -> tuple[float, float]:
    """Relative perplexity change of a test model over a reference scored on the same tokens, and the
    half-width of its 95 % confidence interval.

    The ratio of perplexities is exp(mean(d)) with d the per-token NLL difference; pairing the tokens
    removes the text's own variance, so the interval (normal approximation, delta method) says whether a
    change is resolved by this many tokens.
    """
    d = (test_nll.double() - ref_nll.double()).flatten()
    if d.numel() == 0:
        raise ValueError("perplexity_change needs at least one scored token")
    ratio = math.exp(d.mean().item())
    se = d.std().item() / math.sqrt(d.numel()) if d.numel() > 1 else 0.0
    return ratio - 1.0, 1.96 * se * ratio


def greedy_match_length(reference: Sequence[int], test: Sequence[int]) -> int:
    """How many leading tokens two greedy continuations share (the index of the first difference)."""
    n = 0
    for a, b in zip(reference, test, strict=False):
        if a != b:
            break
        n += 1
    return n


def quantile(values: torch.Tensor, q: float) -> float:
    """The q-quantile (0..1) of a 1-D tensor, linearly interpolated; 0 for an empty tensor."""
    if values.numel() == 0:
        return 0.0
    return torch.quantile(values.double(), q).item()

"""The eval metrics on distributions whose answers are known in closed form."""

from __future__ import annotations

import math

import pytest
import torch

from edgeinfer.eval.metrics import (
    greedy_match_length,
    kl_divergence,
    perplexity,
    perplexity_change,
    quantile,
    token_nll,
    top1_agreement,
)
from edgeinfer.eval.scoring import plan_windows


def _lp(probs: list[list[float]]) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float64).log()


def test_kl_of_identical_distributions_is_zero():
    lp = torch.log_softmax(torch.randn(5, 1000, generator=torch.Generator().manual_seed(0)), -1)
    assert torch.equal(kl_divergence(lp, lp), torch.zeros(5))


def test_kl_of_a_known_pair_matches_the_closed_form():
    # KL([p, 1-p] || [q, 1-q]) = p ln(p/q) + (1-p) ln((1-p)/(1-q))
    p, q = 0.8, 0.4
    expected = p * math.log(p / q) + (1 - p) * math.log((1 - p) / (1 - q))
    got = kl_divergence(_lp([[p, 1 - p]]), _lp([[q, 1 - q]]))
    assert got.item() == pytest.approx(expected, rel=1e-6)
    # not symmetric: the reference is the first argument
    reverse = q * math.log(q / p) + (1 - q) * math.log((1 - q) / (1 - p))
    assert kl_divergence(_lp([[q, 1 - q]]), _lp([[p, 1 - p]])).item() == pytest.approx(reverse, rel=1e-6)


def test_kl_treats_zero_reference_probability_as_zero_and_missing_support_as_infinite():
    ref = _lp([[0.5, 0.5, 0.0]])
    assert kl_divergence(ref, _lp([[0.25, 0.25, 0.5]])).item() == pytest.approx(math.log(2), rel=1e-6)
    assert math.isinf(kl_divergence(ref, _lp([[1.0, 0.0, 0.0]])).item())


def test_perplexity_of_a_uniform_model_is_the_vocabulary_size():
    vocab = 384
    lp = torch.full((50, vocab), -math.log(vocab))
    targets = torch.randint(0, vocab, (50,), generator=torch.Generator().manual_seed(1))
    assert perplexity(token_nll(lp, targets)) == pytest.approx(vocab, rel=1e-5)


def test_perplexity_is_exp_of_the_mean_nll():
    lp = _lp([[0.5, 0.5], [0.25, 0.75]])
    nll = token_nll(lp, torch.tensor([0, 1]))
    assert nll.tolist() == pytest.approx([math.log(2), -math.log(0.75)])
    assert perplexity(nll) == pytest.approx(math.exp((math.log(2) - math.log(0.75)) / 2))
    with pytest.raises(ValueError, match="at least one"):
        perplexity([])


def test_perplexity_change_is_the_paired_ratio_with_a_confidence_interval():
    ref = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    change, ci = perplexity_change(ref + 0.1, ref)
    assert change == pytest.approx(math.exp(0.1) - 1) and ci == pytest.approx(0.0)
    # d = [0, 2]: mean 1, sample std sqrt(2), standard error 1
    change, ci = perplexity_change(torch.tensor([1.0, 3.0]), torch.tensor([1.0, 1.0]))
    assert change == pytest.approx(math.e - 1) and ci == pytest.approx(1.96 * math.e)
    assert perplexity(ref + 0.1) / perplexity(ref) - 1 == pytest.approx(perplexity_change(ref + 0.1, ref)[0])


def test_top1_agreement_compares_argmaxes():
    ref = _lp([[0.6, 0.3, 0.1], [0.2, 0.5, 0.3], [0.1, 0.1, 0.8]])
    test = _lp([[0.5, 0.4, 0.1], [0.5, 0.2, 0.3], [0.2, 0.1, 0.7]])
    assert top1_agreement(ref, test).tolist() == [True, False, True]


@pytest.mark.parametrize(
    ("a", "b", "n"),
    [
        ([1, 2, 3, 4], [1, 2, 3, 4], 4),
        ([1, 2, 3, 4], [1, 2, 9, 4], 2),
        ([5, 2], [6, 2], 0),
        ([1, 2, 3], [1, 2], 2),
    ],
)
def test_greedy_match_length_stops_at_the_first_difference(a, b, n):
    assert greedy_match_length(a, b) == n


def test_quantile_interpolates():
    assert quantile(torch.arange(101.0), 0.99) == pytest.approx(99.0)
    assert quantile(torch.tensor([]), 0.5) == 0.0


@pytest.mark.parametrize(
    ("n", "window", "stride", "first"), [(10, 4, 2, 0), (10, 4, 4, 1), (7, 8, 4, 0), (9, 5, 1, 1)]
)
def test_windows_score_every_token_once(n, window, stride, first):
    plan = plan_windows(n, window, stride, first)
    scored = [j for w in plan for j in range(w.first_scored, w.end)]
    assert scored == list(range(first, n))
    for w in plan:
        assert w.end - w.begin <= window and w.begin <= w.first_scored
    # later windows give each scored token at least window - stride tokens of left context
    assert all(w.first_scored - w.begin >= window - stride for w in plan[1:])


def test_bad_windows_are_refused():
    with pytest.raises(ValueError, match="stride"):
        plan_windows(10, 4, 5)
    with pytest.raises(ValueError, match="nothing to score"):
        plan_windows(1, 4, 2, first_scored=1)

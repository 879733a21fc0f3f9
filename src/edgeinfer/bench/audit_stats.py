"""Two-sample statistics for the cache audit: ROC AUC and the Kolmogorov–Smirnov test."""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Sequence


def roc_auc(positives: Sequence[float], negatives: Sequence[float]) -> float:
    """P(a negative scores above a positive) with ties as one half: how well "faster" separates a
    suspected cache hit (positives: lower TTFT) from a never-seen prompt. 0.5: indistinguishable."""
    wins = 0.0
    for p in positives:
        for n in negatives:
            wins += 1.0 if n > p else 0.5 if n == p else 0.0
    return wins / (len(positives) * len(negatives))


def ks_test(a: Sequence[float], b: Sequence[float]) -> tuple[float, float]:
    """(D, p): the largest gap between the two empirical CDFs and its asymptotic two-sided p-value
    (Kolmogorov's distribution at sqrt(n m / (n + m)) D, with Stephens' small-sample correction)."""
    xs, ys = sorted(a), sorted(b)
    d = max(abs(bisect_right(xs, v) / len(xs) - bisect_right(ys, v) / len(ys)) for v in xs + ys)
    ne = len(xs) * len(ys) / (len(xs) + len(ys))
    lam = (math.sqrt(ne) + 0.12 + 0.11 / math.sqrt(ne)) * d
    return d, _kolmogorov_sf(lam)


def _kolmogorov_sf(lam: float) -> float:
    if lam < 1e-3:
        return 1.0
    total = sum((-1) ** (k - 1) * math.exp(-2.0 * k * k * lam * lam) for k in range(1, 101))
    return min(1.0, max(0.0, 2.0 * total))

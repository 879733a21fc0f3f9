"""Two-sample chi-square: do two sets of sampled outcomes come from one distribution?"""

from __future__ import annotations

import math
from collections import Counter


def chi_square_critical(dof: int, alpha_z: float = 3.09) -> float:
    """The chi-square quantile at z (3.09: p = 0.001) by Wilson–Hilferty."""
    k = dof
    return k * (1 - 2 / (9 * k) + alpha_z * math.sqrt(2 / (9 * k))) ** 3


def two_sample_chi_square(a: Counter, b: Counter) -> tuple[float, int]:
    """Pearson's statistic for equal distributions (equal sample sizes), rare outcomes pooled."""
    keys = [k for k in a.keys() | b.keys() if a[k] + b[k] >= 10]
    rest_a = sum(a.values()) - sum(a[k] for k in keys)
    rest_b = sum(b.values()) - sum(b[k] for k in keys)
    pairs = [(a[k], b[k]) for k in keys] + ([(rest_a, rest_b)] if rest_a + rest_b else [])
    stat = sum((x - y) ** 2 / (x + y) for x, y in pairs)
    return stat, len(pairs) - 1

"""The cache audit's statistics, and `edgeinfer audit-cache` against a real node with two tenants."""

from __future__ import annotations

import random

import pytest

from edgeinfer.bench.audit_stats import ks_test, roc_auc


def test_auc_counts_pairs_and_ties() -> None:
    assert roc_auc([1.0, 2.0], [3.0, 4.0]) == 1.0
    assert roc_auc([3.0, 4.0], [1.0, 2.0]) == 0.0
    assert roc_auc([1.0, 3.0], [2.0, 3.0]) == 0.625  # (1<2, 1<3, 3>2, 3=3 half) / 4


def test_ks_matches_scipy() -> None:
    stats = pytest.importorskip("scipy.stats")
    rng = random.Random(1)
    a = [rng.gauss(0, 1) for _ in range(40)]
    for shift in (0.0, 0.5, 1.5):
        b = [rng.gauss(shift, 1) for _ in range(35)]
        d, p = ks_test(a, b)
        ref = stats.ks_2samp(a, b, method="asymp")
        assert d == pytest.approx(ref.statistic)
        assert p == pytest.approx(ref.pvalue, abs=0.03)

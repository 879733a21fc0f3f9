"""Metrics math on hand-built request records (times in seconds, as the client records them)."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from edgeinfer.bench.client import RequestRecord
from edgeinfer.bench.metrics import SLO, Distribution, percentile, summarize


def _record(start: float, ttft: float, gaps: list[float], prompt_tokens: int = 10) -> RequestRecord:
    """A successful request whose first chunk came `ttft` after `start`, then one chunk after each gap."""
    times = [start + ttft]
    for gap in gaps:
        times.append(times[-1] + gap)
    return RequestRecord(ok=True, start=start, ttft=ttft, e2e=times[-1] - start, chunk_times=times,
                         prompt_tokens=prompt_tokens, output_tokens=len(times), usage_reported=True,
                         requested_tokens=len(times))  # fmt: skip


def test_percentile_matches_numpy_linear_interpolation() -> None:
    rng = random.Random(0)
    values = [rng.uniform(0, 100) for _ in range(37)]
    for q in (0, 1, 25, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([5.0], 99) == 5.0


def test_percentile_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="empty"):
        percentile([], 50)
    with pytest.raises(ValueError, match="q must be"):
        percentile([1.0], 101)


def test_itl_and_tpot_of_one_record() -> None:
    r = _record(start=10.0, ttft=0.5, gaps=[0.1, 0.3, 0.2])
    assert r.itls == pytest.approx([0.1, 0.3, 0.2])
    assert r.output_tokens == 4
    assert r.tpot == pytest.approx(0.6 / 3)  # (e2e - ttft) / (tokens - 1)
    assert _record(0.0, 0.2, []).tpot is None  # one token: no time per output token


def test_distribution_in_ms_and_empty_is_nan() -> None:
    d = Distribution.of_seconds([0.1, 0.2, 0.3, 0.4])
    assert (d.mean, d.median, d.max) == pytest.approx((250.0, 250.0, 400.0))
    assert d.p99 == pytest.approx(397.0)
    assert math.isnan(Distribution.of_seconds([]).mean)


def test_summarize_throughput_latency_and_goodput() -> None:
    fast = _record(0.0, 0.1, [0.01] * 9)  # 10 tokens, TPOT 10 ms
    slow_start = _record(0.0, 0.9, [0.01] * 9)  # violates a 500 ms TTFT bound
    slow_decode = _record(0.5, 0.1, [0.05] * 4)  # 5 tokens, TPOT 50 ms: violates a 20 ms TPOT bound
    failed = RequestRecord(ok=False, error="HTTP 500: x", requested_tokens=8)
    s = summarize([fast, slow_start, slow_decode, failed], duration_s=2.0, slo=SLO(ttft_ms=500, tpot_ms=20))
    assert (s.completed, s.failed) == (3, 1)
    assert s.total_output_tokens == 25 and s.total_input_tokens == 30
    assert s.request_throughput == pytest.approx(1.5)
    assert s.output_throughput == pytest.approx(12.5)
    assert s.total_token_throughput == pytest.approx(27.5)
    assert s.ttft_ms.median == pytest.approx(100.0)
    assert s.ttft_ms.mean == pytest.approx((100 + 900 + 100) / 3)
    assert s.itl_ms.mean == pytest.approx((18 * 10 + 4 * 50) / 22)  # pooled over all gaps, not per request
    assert s.tpot_ms.max == pytest.approx(50.0)
    assert s.goodput == pytest.approx(0.5)  # only `fast` meets both bounds, over 2 s
    assert s.slo_met_fraction == pytest.approx(0.25)  # failures count against the SLO
    assert s.requested_output_tokens == 25
    assert s.errors == ["HTTP 500: x"]


def test_goodput_absent_without_slo_and_single_bound_slo() -> None:
    records = [_record(0.0, 0.1, [0.01]), _record(0.0, 0.9, [0.01])]
    assert summarize(records, 1.0, SLO()).goodput is None
    assert summarize(records, 1.0, SLO(ttft_ms=500)).goodput == pytest.approx(1.0)
    assert summarize(records, 1.0, SLO(tpot_ms=5)).goodput == pytest.approx(0.0)


def test_summarize_rejects_zero_duration() -> None:
    with pytest.raises(ValueError, match="duration_s"):
        summarize([], 0.0, SLO())

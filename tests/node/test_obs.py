"""Canary and latency breakdown helpers."""

from __future__ import annotations

import pytest

from edgeinfer.obs.canary import is_degenerate_repetition
from edgeinfer.obs.timing import LatencyBreakdown


def test_repetition_canary() -> None:
    assert is_degenerate_repetition([5] * 32)
    assert is_degenerate_repetition([1, 2, 3] * 11)  # period 3
    assert is_degenerate_repetition(list(range(50)) + [7, 8] * 16)  # only the tail matters
    assert not is_degenerate_repetition([5] * 31)  # too short to judge
    assert not is_degenerate_repetition(list(range(40)))
    assert not is_degenerate_repetition(list(range(9)) * 4)  # period 9 > 8
    with pytest.raises(ValueError):
        is_degenerate_repetition([1], window=1)


def test_latency_breakdown() -> None:
    lat = LatencyBreakdown.from_timestamps(10.0, 10.5, 11.0, 13.0)
    assert (lat.queue, lat.prefill, lat.decode, lat.ttft, lat.e2e) == (0.5, 0.5, 2.0, 1.0, 3.0)
    assert lat.header_value() == "queue=500.0;prefill=500.0;decode=2000.0"
    partial = LatencyBreakdown.from_timestamps(10.0, None, None, None)
    assert partial.header_value() == "" and partial.as_ms()["queue_ms"] is None

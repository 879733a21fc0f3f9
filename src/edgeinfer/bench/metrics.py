"""Turn request records into serving metrics: throughput, latency distributions, goodput under an SLO.

Definitions (as in `vllm bench serve`, so numbers are comparable):
- TTFT: request start to its first content chunk. TPOT: (e2e - TTFT) / (output tokens - 1), per request.
- ITL: gaps between consecutive content chunks, pooled over all requests.
- Throughputs divide totals over successful requests by the wall time from the first send to the last finish.
- Goodput: successful requests per second whose TTFT and TPOT both meet the SLO (an unset bound always holds).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from edgeinfer.bench.client import RequestRecord


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between order statistics (numpy's default)."""
    if not values:
        raise ValueError("percentile of an empty sequence")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass(frozen=True)
class Distribution:
    """Summary of one latency metric, in milliseconds."""

    mean: float
    median: float
    p90: float
    p99: float
    max: float

    @classmethod
    def of_seconds(cls, values: Sequence[float]) -> Distribution:
        """Summarise values given in seconds; an empty input gives NaNs (no data, not zero latency)."""
        if not values:
            return cls(*(math.nan,) * 5)
        ms = [v * 1000.0 for v in values]
        return cls(
            mean=statistics.fmean(ms),
            median=percentile(ms, 50),
            p90=percentile(ms, 90),
            p99=percentile(ms, 99),
            max=max(ms),
        )


@dataclass(frozen=True)
class SLO:
    """Latency bounds for goodput, in milliseconds; None leaves a bound unchecked."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None

    @property
    def active(self) -> bool:
        return self.ttft_ms is not None or self.tpot_ms is not None

    def met_by(self, record: RequestRecord) -> bool:
        """True if `record` succeeded and meets every set bound (TPOT is vacuous for one-token answers)."""
        if not record.ok:
            return False
        if self.ttft_ms is not None and record.ttft * 1000.0 > self.ttft_ms:
            return False
        tpot = record.tpot
        return self.tpot_ms is None or tpot is None or tpot * 1000.0 <= self.tpot_ms


@dataclass(frozen=True)
class Summary:
    """Everything a run reports; `asdict` gives its JSON form."""

    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    ttft_ms: Distribution
    tpot_ms: Distribution
    itl_ms: Distribution
    e2e_ms: Distribution
    goodput: float | None
    slo_met_fraction: float | None
    usage_reported_fraction: float
    requested_output_tokens: int
    errors: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarize(records: Sequence[RequestRecord], duration_s: float, slo: SLO) -> Summary:
    """Aggregate `records` of a run that lasted `duration_s` seconds of wall time."""
    if duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    ok = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    n_in = sum(r.prompt_tokens for r in ok)
    n_out = sum(r.output_tokens for r in ok)
    good = sum(slo.met_by(r) for r in ok) if slo.active else None
    return Summary(
        completed=len(ok),
        failed=len(failed),
        duration_s=duration_s,
        total_input_tokens=n_in,
        total_output_tokens=n_out,
        request_throughput=len(ok) / duration_s,
        output_throughput=n_out / duration_s,
        total_token_throughput=(n_in + n_out) / duration_s,
        ttft_ms=Distribution.of_seconds([r.ttft for r in ok]),
        tpot_ms=Distribution.of_seconds([t for r in ok if (t := r.tpot) is not None]),
        itl_ms=Distribution.of_seconds([gap for r in ok for gap in r.itls]),
        e2e_ms=Distribution.of_seconds([r.e2e for r in ok]),
        goodput=None if good is None else good / duration_s,
        slo_met_fraction=None if good is None or not records else good / len(records),
        usage_reported_fraction=(sum(r.usage_reported for r in ok) / len(ok)) if ok else 0.0,
        requested_output_tokens=sum(r.requested_tokens for r in ok),
        errors=sorted({r.error for r in failed})[:20],
    )

"""Per-request latency breakdown: queue, prefill, decode (and time to first token, end to end)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LatencyBreakdown:
    """Seconds spent in each phase of one request; None where the phase was never reached or is unknown.

    queue: arrival → first scheduled (includes waiting for a model load); prefill: first scheduled → first
    token; decode: first token → finished. An upstream pool member only reports what the node sees
    (ttft, e2e), never its internal phases.
    """

    queue: float | None = None
    prefill: float | None = None
    decode: float | None = None
    ttft: float | None = None
    e2e: float | None = None

    @classmethod
    def from_timestamps(
        cls,
        arrival: float,
        first_scheduled: float | None,
        first_token: float | None,
        finished: float | None,
    ) -> LatencyBreakdown:
        """Build from monotonic timestamps (seconds, same clock)."""
        return cls(
            queue=_span(arrival, first_scheduled),
            prefill=_span(first_scheduled, first_token),
            decode=_span(first_token, finished),
            ttft=_span(arrival, first_token),
            e2e=_span(arrival, finished),
        )

    def header_value(self) -> str:
        """`queue=1.2;prefill=30.5;decode=120.0` in milliseconds; phases not known are left out."""
        parts = [
            f"{name}={value * 1000:.1f}"
            for name, value in (("queue", self.queue), ("prefill", self.prefill), ("decode", self.decode))
            if value is not None
        ]
        return ";".join(parts)

    def as_ms(self) -> dict[str, float | None]:
        """Milliseconds per phase, for the JSON access log."""
        return {
            f"{name}_ms": None if value is None else round(value * 1000, 3)
            for name, value in (
                ("queue", self.queue),
                ("prefill", self.prefill),
                ("decode", self.decode),
                ("ttft", self.ttft),
                ("e2e", self.e2e),
            )
        }


def _span(start: float | None, end: float | None) -> float | None:
    if start is None or end is None:
        return None
    # Clamp: phases measured on the same monotonic clock never run backwards, but rounding across
    # threads can give -1e-7.
    return max(0.0, end - start)

"""Render a benchmark result as a human-readable table and as JSON."""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

from edgeinfer.bench.metrics import Distribution, Summary
from edgeinfer.bench.runner import BenchConfig, BenchResult

_WIDTH = 52


def _line(label: str, value: str) -> str:
    return f"{label:<36}{value:>16}"


def _num(value: float | None, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return f"{value:,.{digits}f}"


def _distribution_lines(name: str, dist: Distribution) -> list[str]:
    return [
        f"{'-' * 12} {name} {'-' * (_WIDTH - 14 - len(name))}",
        _line(f"Mean {name} (ms):", _num(dist.mean)),
        _line(f"Median {name} (ms):", _num(dist.median)),
        _line(f"P99 {name} (ms):", _num(dist.p99)),
    ]


def format_table(summary: Summary, title: str = "Serving Benchmark Result") -> str:
    """The summary as the fixed-width text table `vllm bench serve` users know."""
    lines = [
        f"{' ' + title + ' ':=^{_WIDTH}}",
        _line("Successful requests:", str(summary.completed)),
        _line("Failed requests:", str(summary.failed)),
        _line("Benchmark duration (s):", _num(summary.duration_s)),
        _line("Total input tokens:", str(summary.total_input_tokens)),
        _line("Total generated tokens:", str(summary.total_output_tokens)),
        _line("Requested output tokens:", str(summary.requested_output_tokens)),
        _line("Request throughput (req/s):", _num(summary.request_throughput)),
        _line("Output token throughput (tok/s):", _num(summary.output_throughput)),
        _line("Total token throughput (tok/s):", _num(summary.total_token_throughput)),
    ]
    if summary.goodput is not None:
        lines.append(_line("Request goodput (req/s):", _num(summary.goodput)))
        lines.append(_line("Requests meeting the SLO (%):", _num(100 * (summary.slo_met_fraction or 0.0), 1)))
    lines += _distribution_lines("TTFT", summary.ttft_ms)
    lines += _distribution_lines("TPOT", summary.tpot_ms)
    lines += _distribution_lines("ITL", summary.itl_ms)
    lines += _distribution_lines("E2E", summary.e2e_ms)
    lines.append("=" * _WIDTH)
    if summary.usage_reported_fraction < 1.0 and summary.completed:
        missing = 100 * (1 - summary.usage_reported_fraction)
        lines.append(f"note: {missing:.0f}% of answers had no usage; tokens counted from chunks and words")
    lines += [f"error: {e}" for e in summary.errors]
    return "\n".join(lines)


def result_json(
    result: BenchResult, config: BenchConfig, extra: dict[str, Any], detailed: bool
) -> dict[str, Any]:
    """The JSON document for a run: config, summary and (if `detailed`) every request's timings."""
    doc: dict[str, Any] = {"config": _config_dict(config), **extra, "summary": result.summary.to_dict()}
    if detailed:
        doc["requests"] = [
            {
                "ok": r.ok,
                "error": r.error,
                "ttft_ms": r.ttft * 1000,
                "e2e_ms": r.e2e * 1000,
                "itl_ms": [gap * 1000 for gap in r.itls],
                "prompt_tokens": r.prompt_tokens,
                "output_tokens": r.output_tokens,
                "requested_tokens": r.requested_tokens,
                "finish_reason": r.finish_reason,
            }
            for r in result.records
        ]
    return doc


def _config_dict(config: BenchConfig) -> dict[str, Any]:
    doc = asdict(config)
    doc.pop("api_key", None)  # never write credentials to a results file
    doc["request_rate"] = "inf" if math.isinf(config.request_rate) else config.request_rate
    return doc


def write_json(path: Path, doc: dict[str, Any]) -> None:
    """Write `doc` to `path` (creating parent folders), NaN written as null so any JSON reader accepts it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_nan_to_none(doc), indent=2) + "\n")


def _nan_to_none(value: Any) -> Any:
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return None
    if isinstance(value, dict):
        return {k: _nan_to_none(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_nan_to_none(v) for v in value]
    return value

"""Per-policy numbers from a simulation, the markdown table, and the JSON the tests compare."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from edgeinfer.fleet.sim_run import PolicyRun, SimResult


def policy_metrics(result: SimResult, run: PolicyRun) -> dict[str, float]:
    return {
        k: float(v) if isinstance(v, float | np.floating) else int(v)
        for k, v in _metrics(result, run).items()
    }


def _metrics(result: SimResult, run: PolicyRun) -> dict[str, float]:
    """TTFT/E2E percentiles over served requests (ms); SLO p99 counts a reject as a miss (infinite TTFT)."""
    sc, fleet, arr = result.scenario, run.fleet, result.arrivals
    rec = fleet.records
    served = rec.node >= 0
    n = len(arr)
    ttft_ms, e2e_ms = rec.ttft[served] * 1000, rec.e2e[served] * 1000
    # Served at a location at most N ms of RTT away from the client (a reject is not).
    within = served & (rec.rtt * 1000 <= sc.report.within_ms)
    hours = len(fleet.nodes) * sc.duration_s / 3600
    busy = sum(node.busy_s for node in fleet.nodes)
    tokens = int((arr.prompt[served] + arr.output[served]).sum())
    node_loc = np.array([node.location for node in fleet.nodes])[np.maximum(rec.node, 0)]
    all_ttft = np.where(served, rec.ttft * 1000, np.inf)
    return {
        "requests": n,
        "served": int(served.sum()),
        "rejected": n - int(served.sum()),
        "rejected_pct": 100 * (n - served.sum()) / max(n, 1),
        "ttft_p50_ms": _pct(ttft_ms, 50),
        "ttft_p99_ms": _pct(ttft_ms, 99),
        "e2e_p50_ms": _pct(e2e_ms, 50),
        "e2e_p99_ms": _pct(e2e_ms, 99),
        # "higher": an actual sample, so more than 1 % rejected gives inf rather than inf - inf = nan.
        "slo_p99_ttft_ms": float(np.percentile(all_ttft, 99, method="higher")) if n else math.nan,
        "within_pct": 100 * within.sum() / max(n, 1),
        "spilled_pct": 100 * (served & (node_loc != arr.city)).sum() / max(n, 1),
        "prefix_hit_pct": 100 * rec.cached[served].sum() / max(int(arr.prompt[served].sum()), 1),
        "accelerators": len(fleet.nodes),
        "accelerator_hours": hours,
        "utilisation_pct": 100 * busy / max(hours * 3600, 1e-9),
        "usd_per_m_tokens": hours * sc.report.price_per_accelerator_hour / max(tokens, 1) * 1e6,
        "tokens": tokens,
        "wall_s": run.wall_s,
    }


def _pct(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else math.nan


def all_metrics(result: SimResult) -> dict[str, dict[str, float]]:
    return {run.policy: policy_metrics(result, run) for run in result.runs}


def deterministic(metrics: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """The metrics without wall-clock time: what a fixed seed must reproduce exactly."""
    return {p: {k: v for k, v in m.items() if k != "wall_s"} for p, m in metrics.items()}


COLUMNS = (
    ("policy", None, "{}"),
    ("TTFT p50 ms", "ttft_p50_ms", "{:.0f}"),
    ("TTFT p99 ms", "ttft_p99_ms", "{:.0f}"),
    ("E2E p50 ms", "e2e_p50_ms", "{:.0f}"),
    ("E2E p99 ms", "e2e_p99_ms", "{:.0f}"),
    ("within N ms %", "within_pct", "{:.1f}"),
    ("spilled %", "spilled_pct", "{:.1f}"),
    ("rejected", "rejected", "{:d}"),
    ("rejected %", "rejected_pct", "{:.2f}"),
    ("prefix hit %", "prefix_hit_pct", "{:.1f}"),
    ("util %", "utilisation_pct", "{:.1f}"),
    ("accel-h", "accelerator_hours", "{:.4g}"),
    ("$/M tok", "usd_per_m_tokens", "{:.3f}"),
)


def markdown(result: SimResult, metrics: dict[str, dict[str, float]]) -> str:
    sc = result.scenario
    lines = [
        f"# Fleet simulation: {sc.name}",
        "",
        f"{len(result.locations)} locations, {next(iter(metrics.values()))['accelerators']} accelerators, "
        f"{len(result.arrivals):,} requests over {sc.duration_s / 3600:g} h (seed {sc.seed}); profile: "
        f"{result.profile.device} ({result.profile.source}).",
        "",
        f"within N ms: served at a location at most N = {sc.report.within_ms:g} ms of RTT from the client. "
        f"$/M tok: accelerator-hours at ${sc.report.price_per_accelerator_hour:g} each per million tokens "
        "(prompt + generated). TTFT and E2E percentiles are over served requests, as the client sees them "
        "(RTT included).",
        "",
        "| " + " | ".join(c[0] for c in COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    for policy, m in metrics.items():
        cells = [policy] + [fmt.format(m[key]) for _, key, fmt in COLUMNS[1:]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_report(result: SimResult, out: Path, plots: bool = True) -> dict[str, dict[str, float]]:
    out.mkdir(parents=True, exist_ok=True)
    metrics = all_metrics(result)
    (out / "report.md").write_text(markdown(result, metrics))
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    if plots:
        from edgeinfer.fleet.sim_plots import latency_cdf, world_map

        latency_cdf(result, out / "ttft_cdf.png")
        world_map(result, out / "world_map.png")
    return metrics

"""Markdown tables and matplotlib plots for the serving comparison (used by serve_vs_llamacpp.py)."""

from __future__ import annotations

import math
import platform
import subprocess
from pathlib import Path

import matplotlib.pyplot as plt  # headless machines get the Agg backend automatically
import torch

from edgeinfer.bench.metrics import Summary

# label -> concurrency -> summary
Results = dict[str, dict[int, Summary]]


def machine_info() -> str:
    """One line naming the CPU model, its core count and the software versions."""
    cpu, cores = platform.processor() or "unknown CPU", "?"
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        fields = dict(line.split(":", 1) for line in lscpu.splitlines() if ":" in line)
        cpu, cores = fields.get("Model name", cpu).strip(), fields.get("CPU(s)", cores).strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    versions = f"Python {platform.python_version()}, torch {torch.__version__}"
    return f"{cpu}, {cores} CPUs ({simd_flags()}); {versions}"


_SIMD = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "asimd", "sve")


def simd_flags() -> str:
    """The CPU's vector-extension flags that decide which kernels run (/proc/cpuinfo)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            line = next((ln for ln in f if ln.startswith(("flags", "Features"))), "")
    except OSError:
        line = ""
    have = set(line.partition(":")[2].split())
    return " ".join(flag for flag in _SIMD if flag in have) or "flags unknown"


def _fmt(value: float, digits: int = 1) -> str:
    return "n/a" if value is None or math.isnan(value) else f"{value:,.{digits}f}"


def _ratio(ours: float, peer: float) -> str:
    if not peer or math.isnan(peer) or math.isnan(ours):
        return "n/a"
    return f"{ours / peer:.2f}×"


def decode_tok_s(summary: Summary) -> float:
    """Single-stream decode speed: 1000 / median TPOT (ms)."""
    tpot = summary.tpot_ms.median
    return math.nan if math.isnan(tpot) or tpot <= 0 else 1000.0 / tpot


def comparison_table(results: Results) -> str:
    """One row per (server, concurrency): throughput and latency percentiles."""
    rows = [
        "| server | concurrency | ok/failed | output tok/s | total tok/s | TTFT p50 / p99 ms | "
        "TPOT p50 / p99 ms | ITL p50 / p99 ms | E2E p50 ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for label, levels in results.items():
        for c, s in sorted(levels.items()):
            rows.append(
                f"| {label} | {c} | {s.completed}/{s.failed} | {_fmt(s.output_throughput)} | "
                f"{_fmt(s.total_token_throughput)} | {_fmt(s.ttft_ms.median)} / {_fmt(s.ttft_ms.p99)} | "
                f"{_fmt(s.tpot_ms.median)} / {_fmt(s.tpot_ms.p99)} | {_fmt(s.itl_ms.median)} / "
                f"{_fmt(s.itl_ms.p99)} | {_fmt(s.e2e_ms.median)} |"
            )
    return "\n".join(rows)


def targets_table(ours: dict[int, Summary], peer: dict[int, Summary]) -> str:
    """The three targets of the serving issue, each with both values, the ratio and whether it holds."""
    rows = ["| target | edgeinfer | llama.cpp | ratio | met |", "|---|---|---|---|---|"]
    checks = [
        ("output tok/s at 32 concurrent ≥ 1.5× llama.cpp", 32, lambda s: s.output_throughput, 1.5, True),
        ("TTFT p50 at 8 concurrent ≤ llama.cpp (ms)", 8, lambda s: s.ttft_ms.median, 1.0, False),
        ("TTFT p50 at one stream ≤ llama.cpp (ms)", 1, lambda s: s.ttft_ms.median, 1.0, False),
        ("single-stream decode tok/s ≥ llama.cpp", 1, decode_tok_s, 1.0, True),
    ]
    for name, c, metric, factor, higher_is_better in checks:
        if c not in ours or c not in peer:
            continue
        a, b = metric(ours[c]), metric(peer[c])
        met = a >= factor * b if higher_is_better else a <= factor * b
        rows.append(f"| {name} | {_fmt(a)} | {_fmt(b)} | {_ratio(a, b)} | {'yes' if met else 'no'} |")
    return "\n".join(rows)


def plot_comparison(results: Results, path: Path, title: str) -> None:
    """Three panels against concurrency: output tok/s, TTFT p50 and TPOT p50."""
    panels = [
        ("output tok/s", lambda s: s.output_throughput),
        ("TTFT p50 (ms)", lambda s: s.ttft_ms.median),
        ("TPOT p50 (ms)", lambda s: s.tpot_ms.median),
    ]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, (name, metric) in zip(axes, panels, strict=True):
        for label, levels in results.items():
            cs = sorted(levels)
            ax.plot(cs, [metric(levels[c]) for c in cs], marker="o", label=label)
        levels_seen = sorted({c for levels in results.values() for c in levels})
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels_seen, [str(c) for c in levels_seen])
        ax.set_ylim(bottom=0)
        ax.set_xlabel("concurrent requests")
        ax.set_title(name)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def sweep_table(sweep: dict[float, dict[float, Summary]]) -> str:
    """Batch-window sweep: one row per (window, request rate)."""
    rows = [
        "| batch_window_ms | request rate (req/s) | TTFT p50 ms | TTFT p99 ms | output tok/s | ok/failed |",
        "|---|---|---|---|---|---|",
    ]
    for window, by_rate in sorted(sweep.items()):
        for rate, s in sorted(by_rate.items()):
            rows.append(
                f"| {window:g} | {rate:g} | {_fmt(s.ttft_ms.median)} | {_fmt(s.ttft_ms.p99)} | "
                f"{_fmt(s.output_throughput)} | {s.completed}/{s.failed} |"
            )
    return "\n".join(rows)


def plot_sweep(sweep: dict[float, dict[float, Summary]], path: Path) -> None:
    """TTFT p50, TTFT p99 and output tok/s against request rate, one line per window."""
    panels = [
        ("TTFT p50 (ms)", lambda s: s.ttft_ms.median),
        ("TTFT p99 (ms)", lambda s: s.ttft_ms.p99),
        ("output tok/s", lambda s: s.output_throughput),
    ]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, (name, metric) in zip(axes, panels, strict=True):
        for window, by_rate in sorted(sweep.items()):
            rates = sorted(by_rate)
            ax.plot(rates, [metric(by_rate[r]) for r in rates], marker="o", label=f"window {window:g} ms")
        ax.set_ylim(bottom=0)
        ax.set_xlabel("request rate (req/s, Poisson)")
        ax.set_title(name)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)

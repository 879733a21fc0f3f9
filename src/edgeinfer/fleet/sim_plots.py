"""PNG plots of a simulation: the TTFT CDF per policy and a world map of demand and latency per location."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from edgeinfer.fleet.sim_run import SimResult


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def latency_cdf(result: SimResult, path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    q = np.linspace(0, 100, 1001)
    for run in result.runs:
        rec = run.fleet.records
        ttft = rec.ttft[rec.node >= 0] * 1000
        if len(ttft):
            # Rejected requests never get a first token: the curve tops out at the served share.
            share = len(ttft) / len(rec.ttft)
            ax.plot(np.percentile(ttft, q), q / 100 * share, label=run.policy)
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (ms, client's view)")
    ax.set_ylabel("share of requests")
    ax.set_title(f"TTFT CDF: {result.scenario.name}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def world_map(result: SimResult, path: Path) -> None:
    """One panel per policy: each location at its coordinates, sized by its demand, coloured by its clients'
    median TTFT."""
    plt = _pyplot()
    from matplotlib.colors import LogNorm

    locs = result.locations
    lon, lat = np.array([x.lon for x in locs]), np.array([x.lat for x in locs])
    counts = np.bincount(result.arrivals.city, minlength=len(locs))
    size = 4 + 300 * counts / max(counts.max(), 1)
    cols = 2 if len(result.runs) > 1 else 1
    rows = (len(result.runs) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(7 * cols, 3.8 * rows), squeeze=False)
    medians = [_median_by_city(run, result) for run in result.runs]
    finite = np.concatenate([m[np.isfinite(m)] for m in medians]) if medians else np.array([1.0])
    norm = LogNorm(vmin=max(finite.min(), 1.0), vmax=max(finite.max(), 2.0))
    for ax, run, med in zip(axes.flat, result.runs, medians, strict=False):
        sc = ax.scatter(lon, lat, s=size, c=np.where(np.isfinite(med), med, norm.vmax), cmap="viridis",
                        norm=norm, alpha=0.75, edgecolors="none")  # fmt: skip
        ax.set_title(f"{run.policy}: median TTFT per client location")
        ax.set_xlim(-180, 180)
        ax.set_ylim(-60, 75)
        ax.set_aspect("equal")
        ax.grid(True, alpha=0.3)
        fig.colorbar(sc, ax=ax, label="ms", shrink=0.8)
    for ax in list(axes.flat)[len(result.runs) :]:
        ax.axis("off")
    fig.suptitle("marker area: requests from the location; colour: their median TTFT")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _median_by_city(run, result: SimResult) -> np.ndarray:
    rec, city = run.fleet.records, result.arrivals.city
    out = np.full(len(result.locations), np.nan)
    served = rec.node >= 0
    order = np.argsort(city[served], kind="stable")
    ttft, c = rec.ttft[served][order] * 1000, city[served][order]
    bounds = np.flatnonzero(np.diff(c)) + 1
    for chunk_c, chunk_t in zip(np.split(c, bounds), np.split(ttft, bounds), strict=True):
        if len(chunk_c):
            out[chunk_c[0]] = np.median(chunk_t)
    return out

"""How the fleet simulator's run time grows with requests and locations (world-300 scenario, peak hour).

Each point simulates `--minutes` of the world-300 scenario from 11:00 UTC (the daily peak of the most populous
metros) with the accelerators scaled with the locations (4 / 3 per location) and the request rate as given,
timing each policy as process CPU time (one core; other work on the machine barely moves it).

    .venv/bin/python bench/fleet_sim_scale.py [--minutes 10] [--write-docs]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from edgeinfer.fleet.sim_demand import generate
from edgeinfer.fleet.sim_profile import load_profile
from edgeinfer.fleet.sim_run import build_locations, run_policy
from edgeinfer.fleet.sim_scenario import load_scenario

sys.path.insert(0, str(Path(__file__).parent))
from docs_table import replace_section

GRID = ((100, 20.0), (200, 20.0), (300, 10.0), (300, 20.0), (300, 40.0))
POLICIES = ("router", "nearest", "least-loaded", "round-robin")


def machine() -> str:
    """The CPU's model name (the simulator is single-threaded pure Python + numpy; no torch)."""
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def point(locations: int, rate: float, minutes: float) -> tuple[int, dict[str, float]]:
    sc = load_scenario("world-300.toml")
    sc = replace(
        sc,
        start="2026-06-01T11:00:00",
        duration_s=minutes * 60,
        locations=replace(sc.locations, count=locations),
        nodes=replace(sc.nodes, accelerators=locations * 4 // 3),
        demand=replace(sc.demand, requests_per_s=rate),
    )
    profile, locs = load_profile(sc.profile_path()), build_locations(sc)
    arrivals = generate(sc, locs, np.random.default_rng(sc.seed))
    cpu = {}
    for policy in POLICIES:
        started = time.process_time()
        run_policy(sc, profile, locs, arrivals, policy, progress=False)
        cpu[policy] = time.process_time() - started
    return len(arrivals), cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args()
    load_before = os.getloadavg()[0]
    rows = []
    for locations, rate in GRID:
        n, cpu = point(locations, rate, args.minutes)
        per = " | ".join(f"{cpu[p]:.1f} s ({1e6 * cpu[p] / n:.0f} µs)" for p in POLICIES)
        rows.append(f"| {locations} | {locations * 4 // 3} | {rate:g} | {n:,} | {per} |")
        print(rows[-1], flush=True)
    body = "\n".join(
        [
            "### Fleet simulator run time",
            "",
            f"Machine: {machine()}, one process; 1-min load average {load_before:.1f} before, "
            f"{os.getloadavg()[0]:.1f} after. Process CPU time per policy (µs per request in brackets), "
            f"{args.minutes:g} simulated minutes of `world-300.toml` from 11:00 UTC.",
            f"Command: `.venv/bin/python bench/fleet_sim_scale.py --minutes {args.minutes:g} --write-docs`",
            "",
            "| locations | accelerators | requests/s | requests | " + " | ".join(POLICIES) + " |",
            "|---|---|---|---|" + "---|" * len(POLICIES),
            *rows,
        ]
    )
    print(body)
    if args.write_docs:
        replace_section(Path(__file__).parents[1] / "docs/benchmarks.md", "fleet-sim-scale", body)


if __name__ == "__main__":
    main()

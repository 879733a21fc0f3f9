"""`edgeinfer fleet simulate --scenario FILE`: run a scenario under each policy, write the report folder.

With `--accelerators 300,450,600` it runs once per fleet size and adds `sweep.md`: p99 TTFT and rejects per
policy and size, and the smallest size from which on each policy holds the scenario's p99 TTFT SLO (at that
size and every larger one tested).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from edgeinfer.fleet.sim_report import write_report
from edgeinfer.fleet.sim_run import simulate
from edgeinfer.fleet.sim_scenario import POLICY_NAMES, Scenario, load_scenario, parse_policies


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scenario", required=True, help="TOML file, or a packaged name (world-300.toml)")
    p.add_argument("--out", type=Path, default=None, help="report folder (default: fleet-sim/<scenario>)")
    p.add_argument("--policies", default=None, help=f"comma-separated subset of {','.join(POLICY_NAMES)}")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--duration-s", type=float, default=None, help="simulated time (overrides the scenario)")
    p.add_argument("--start", default=None, help="UTC start, e.g. 2026-06-01T11:00:00 (sets local times)")
    p.add_argument("--requests-per-s", type=float, default=None, help="fleet-wide mean request rate")
    p.add_argument("--accelerators", default=None, help="fleet size, or a comma-separated list to sweep")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--no-progress", action="store_true")


def run(args: argparse.Namespace) -> int:
    scenario = _overrides(load_scenario(args.scenario), args)
    out = args.out or Path("fleet-sim") / scenario.name
    sizes = [int(x) for x in args.accelerators.split(",")] if args.accelerators else [None]
    sweep = {}
    for size in sizes:
        started = time.perf_counter()
        result = simulate(scenario, progress=not args.no_progress, accelerators=size)
        folder = out if len(sizes) == 1 else out / f"accelerators-{size}"
        metrics = write_report(result, folder, plots=not args.no_plots)
        sweep[size] = metrics
        print((folder / "report.md").read_text())
        print(f"wrote {folder} ({time.perf_counter() - started:.1f} s)", file=sys.stderr)
    if len(sizes) > 1:
        (out / "sweep.md").write_text(sweep_markdown(scenario, sweep))
        (out / "sweep.json").write_text(json.dumps({str(k): v for k, v in sweep.items()}, indent=1) + "\n")
        print((out / "sweep.md").read_text())
    return 0


def _overrides(scenario: Scenario, args: argparse.Namespace) -> Scenario:
    if args.policies:
        names = parse_policies(p.strip() for p in args.policies.split(","))
        scenario = replace(scenario, policies=names)
    if args.seed is not None:
        scenario = replace(scenario, seed=args.seed)
    if args.start is not None:
        scenario = replace(scenario, start=args.start)
    if args.duration_s is not None:
        scenario = replace(scenario, duration_s=args.duration_s)
    if args.requests_per_s is not None:
        scenario = replace(scenario, demand=replace(scenario.demand, requests_per_s=args.requests_per_s))
    return scenario


def sweep_markdown(scenario: Scenario, sweep: dict) -> str:
    slo = scenario.report.slo_ttft_p99_ms
    policies = list(next(iter(sweep.values())))
    lines = [
        f"# Accelerators against a p99 TTFT SLO of {slo:g} ms: {scenario.name}",
        "",
        "p99 TTFT over all requests, a rejected request counting as a miss; rejects in brackets.",
        "",
        "| accelerators | " + " | ".join(policies) + " |",
        "|---|" + "---|" * len(policies),
    ]
    for size, metrics in sweep.items():
        cells = [
            f"{metrics[p]['slo_p99_ttft_ms']:.0f} ms ({metrics[p]['rejected_pct']:.2f} %)" for p in policies
        ]
        lines.append(f"| {size} | " + " | ".join(cells) + " |")
    needed = [_needed(sweep, p, slo) for p in policies]
    lines.append("| **needed** | " + " | ".join(needed) + " |")
    return "\n".join(lines) + "\n"


def _needed(sweep: dict, policy: str, slo: float) -> str:
    sizes = sorted(sweep)
    holds = [sweep[size][policy]["slo_p99_ttft_ms"] <= slo for size in sizes]
    for i, size in enumerate(sizes):
        if all(holds[i:]):
            return str(size)
    return f"> {sizes[-1]}"

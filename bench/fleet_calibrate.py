"""Calibrate the fleet simulator against the real loopback fleet: predicted vs measured TTFT and E2E.

1. A tiny Llama checkpoint is written and profiled on this machine (bench/fleet_profile.py, one thread,
   process CPU time; `--wall-clock-profile` times it by the wall clock instead, contention included).
2. `edgeinfer fleet up --locations 3 --emulate-rtt` starts NATS, a node and a router per location (FRA, AMS,
   LHR) with that model.
3. For each load level the arrivals of `scenarios/loopback-3.toml` at that rate are drawn by the simulator's
   demand model and replayed against the fleet: each request goes to the router of its client's location
   (`x-client-location`), streaming, with the drawn prompt (random words) and output length (`ignore_eos`).
4. The simulator replays the same arrivals, with the prompt lengths the nodes reported, through the same
   scenario and the measured profile; predicted and measured p50/p99 go to docs/fleet.md.

    .venv/bin/python bench/fleet_calibrate.py [--rates 2 6] [--duration-s 90] [--repeat 2] [--write-docs]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import httpx
import numpy as np

from edgeinfer.bench.client import RequestSpec, build_payload, send_request
from edgeinfer.fleet.sim_demand import Arrivals, generate
from edgeinfer.fleet.sim_profile import load_profile
from edgeinfer.fleet.sim_run import build_locations, run_policy
from edgeinfer.fleet.sim_scenario import load_scenario
from edgeinfer.fleet.up import SITES

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(Path(__file__).parent))
from docs_table import replace_section  # noqa: E402
from fleet_profile import measure  # noqa: E402
from helpers.tiny_models import CORPUS, make_tiny  # noqa: E402

MODEL = "tiny"
WORDS = sorted({w for line in CORPUS for w in re.findall(r"[a-z]+", line.lower())})
NODE_ARGS = ["--threads", "1", "--max-num-seqs", "16", "--kv-cache-memory", "64MiB"]
NODE_ARGS += ["--memory-budget", "256MiB"]


def scenario_for(profile_path: Path, rate: float, duration_s: float):
    """loopback-3.toml with the fleet-up sites, the tiny model's profile, and the given rate."""
    sc = load_scenario("loopback-3.toml")
    weights = {site["code"]: site["population"] for site in sc.locations.sites}
    sites = tuple(
        {"code": code, "lat": lat, "lon": lon, "population": weights.get(code, 1), "region": "EU"}
        for code, lat, lon in SITES[:3]
    )
    model = replace(sc.models[0], name=MODEL, profile=f"{MODEL}-fp32")
    return replace(
        sc,
        base_dir=profile_path.parent,
        duration_s=duration_s,
        policies=("router",),
        locations=replace(sc.locations, sites=sites),
        models=(model,),
        demand=replace(sc.demand, requests_per_s=rate),
        nodes=replace(sc.nodes, profile=profile_path.name, max_batch=16),
    )


class LoopbackFleet:
    """`edgeinfer fleet up` as a child process; `urls` maps location code -> router URL."""

    def __init__(self, model_dir: Path, workdir: Path) -> None:
        cmd = [sys.executable, "-m", "edgeinfer.cli", "fleet", "up", "--locations", "3", "--emulate-rtt"]
        cmd += ["--model", f"{MODEL}={model_dir}", "--workdir", str(workdir)]
        cmd += [f"--node-arg={a}" for a in NODE_ARGS]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, start_new_session=True)
        self.urls: dict[str, str] = {}
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            found = re.match(r"(\w{3})\s+router (\S+)", line)
            if found:
                self.urls[found[1]] = found[2]
            if line.startswith("fleet file and logs"):
                return
        raise RuntimeError(f"fleet up exited with {self.proc.wait()} before it was ready")

    def stop(self) -> None:
        """Ctrl-C to `fleet up` (it stops routers, nodes, NATS); its whole process group if it hangs."""
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(90)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


def prompt_text(tokens: int, rng: random.Random) -> str:
    """Random corpus words, about one token each: no two prompts share a cacheable prefix."""
    return " ".join(rng.choice(WORDS) for _ in range(max(1, tokens)))


async def replay(arrivals: Arrivals, codes: list[str], urls: dict[str, str], seed: int) -> list:
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=512)
    async with httpx.AsyncClient(timeout=120.0, limits=limits) as client:
        start = time.perf_counter()

        async def one(i: int):
            await asyncio.sleep(max(0.0, start + float(arrivals.time[i]) - time.perf_counter()))
            code = codes[int(arrivals.city[i])]
            spec = RequestSpec(prompt_text(int(arrivals.prompt[i]), rng), int(arrivals.output[i]), 0)
            payload = build_payload("/v1/completions", MODEL, spec)
            url = urls[code] + "/v1/completions"
            return await send_request(client, url, payload, spec, {"x-client-location": code})

        return await asyncio.gather(*(one(i) for i in range(len(arrivals))))


def measured_arrivals(arrivals: Arrivals, records: list) -> tuple[Arrivals, np.ndarray]:
    """The replayed arrivals with the prompt lengths the nodes counted; `ok` marks served requests."""
    ok = np.array([r.ok and r.output_tokens > 0 for r in records])
    prompt = np.array(
        [r.prompt_tokens if r.prompt_tokens else p for r, p in zip(records, arrivals.prompt, strict=True)]
    )
    zeros = np.zeros(len(arrivals), dtype=np.int64)
    return replace(arrivals, prompt=prompt.astype(np.int64), prefix_key=zeros, prefix_len=zeros), ok


def pct(values: np.ndarray, q: float) -> float:
    values = values[~np.isnan(values)]
    return float(np.percentile(values, q) * 1000) if len(values) else float("nan")


def one_level(fleet: LoopbackFleet, profile_path: Path, rate: float, duration_s: float, seed: int) -> dict:
    sc = replace(scenario_for(profile_path, rate, duration_s), seed=seed)
    locations = build_locations(sc)
    arrivals = generate(sc, locations, np.random.default_rng(seed))
    codes = [loc.code for loc in locations]
    load_before = os.getloadavg()[0]
    records = asyncio.run(replay(arrivals, codes, fleet.urls, seed))
    load_after = os.getloadavg()[0]
    replayed, ok = measured_arrivals(arrivals, records)
    run = run_policy(sc, load_profile(profile_path), locations, replayed, "router", progress=False)
    rec = run.fleet.records
    real_ttft = np.array([r.ttft if r.ok else np.nan for r in records])
    real_e2e = np.array([r.e2e if r.ok else np.nan for r in records])
    row = {"rate": rate, "seed": seed, "requests": len(arrivals), "failed": int((~ok).sum())}
    row["errors"] = sorted({r.error[:120] for r in records if not r.ok})[:3]
    for name, real, sim in (("ttft", real_ttft, rec.ttft), ("e2e", real_e2e, rec.e2e)):
        for q in (50, 99):
            row[f"{name}_p{q}_measured"] = pct(real, q)
            row[f"{name}_p{q}_predicted"] = pct(sim[ok], q)
    row["load"] = (load_before, load_after)
    return row


def table(rows: list[dict], profile: dict, args: argparse.Namespace) -> str:
    entry = profile["models"][f"{MODEL}-fp32"]
    clock = profile["source"].split(", ", 1)[1]
    lines = [
        "### Calibration: loopback fleet vs simulator",
        "",
        f"Machine: {profile['device']}; profile of the tiny Llama ({clock}, one thread): prefill "
        f"{entry['prefill_tok_s']:.0f} tok/s + {entry['prefill_overhead_ms']:.1f} ms, step "
        f"{entry['step_base_ms']:.2f} + {entry['step_per_seq_ms']:.3f} × batch + "
        f"{entry['step_per_kctx_ms']:.3f} × kctx ms.",
        f"Command: `.venv/bin/python bench/fleet_calibrate.py --rates {' '.join(map(str, args.rates))} "
        f"--duration-s {args.duration_s:g} --repeat {args.repeat} --write-docs`",
        "",
        "| req/s | run | requests | failed | TTFT p50 sim / real ms | TTFT p99 sim / real ms "
        "| E2E p50 sim / real ms | E2E p99 sim / real ms | TTFT p50 error | E2E p50 error | load avg |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(rows):

        def pair(name: str, r: dict = r) -> str:
            return f"{r[name + '_predicted']:.0f} / {r[name + '_measured']:.0f}"

        def err(name: str, r: dict = r) -> str:
            return f"{100 * (r[name + '_predicted'] / r[name + '_measured'] - 1):+.0f} %"

        lines.append(
            f"| {r['rate']:g} | {i % args.repeat + 1} | {r['requests']} | {r['failed']} | {pair('ttft_p50')} "
            f"| {pair('ttft_p99')} | {pair('e2e_p50')} | {pair('e2e_p99')} | {err('ttft_p50')} "
            f"| {err('e2e_p50')} | {r['load'][0]:.1f} → {r['load'][1]:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", type=float, nargs="+", default=[2.0, 6.0])
    ap.add_argument("--duration-s", type=float, default=90.0)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--write-docs", action="store_true")
    ap.add_argument("--wall-clock-profile", action="store_true", help="profile by wall clock, not CPU time")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="fleet-calibrate-") as tmp:
        work = Path(tmp)
        model_dir = make_tiny("llama", work / "tiny", max_position_embeddings=4096)
        profile = measure(MODEL, str(model_dir), ["fp32"], wall=args.wall_clock_profile)
        profile_path = work / "profile.json"
        profile_path.write_text(json.dumps(profile))
        fleet = LoopbackFleet(model_dir, work / "fleet")
        rows = []
        try:
            for rate in args.rates:
                for rep in range(args.repeat):
                    rows.append(one_level(fleet, profile_path, rate, args.duration_s, seed=1 + rep))
                    print(json.dumps(rows[-1]), flush=True)
        finally:
            fleet.stop()
    body = table(rows, profile, args)
    print(body)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    if args.write_docs:
        replace_section(ROOT / "docs/fleet.md", "fleet-calibration", body)


if __name__ == "__main__":
    main()

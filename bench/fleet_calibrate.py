"""Calibrate the fleet simulator against the real loopback fleet: predicted vs measured TTFT and E2E.

1. A small random Llama checkpoint (MODEL_SHAPE) with a word-level vocabulary (every token is a word, so
   every token streams as text and the client's first chunk is the first token) is written and profiled on
   this machine (bench/fleet_profile.py, one thread, process CPU time; `--wall-clock-profile` times it by the
   wall clock instead, contention included).
2. `edgeinfer fleet up --locations 3 --emulate-rtt` starts NATS, a node and a router per location (FRA, AMS,
   LHR) with that model.
3. For each load level the arrivals of `scenarios/loopback-3.toml` at that rate are drawn by the simulator's
   demand model and replayed against the fleet: each request goes to the router of its client's location
   (`x-client-location`), streaming, with the drawn prompt (random words) and output length (`ignore_eos`,
   sampled at temperature 1 so that a random model does not settle on one token).
   Before the load levels, sequential requests on the idle fleet, to a node directly and through its
   router, measure what serving adds to the engine's times: per request on the node (HTTP, tokenizing, the
   first event; `request_overhead_ms`, on the node's clock), per token and stream (detokenizing, an SSE event
   relayed by the router; `step_per_seq_ms`, so it grows with the batch as it does on the node), and the
   router's hop (`network.router_ms`, latency only). The `served` profile is the engine profile plus these.
   The same probes read the CPU time of every process: what the fleet burns while idle (status heartbeats,
   NATS) and what the routers, NATS and this load generator spend per request and per streamed token.
   With these the scenario's `[host]` puts the three nodes on this machine's cores, shared with that work
   (fleet/sim_host.py), as the loopback fleet runs.
4. The simulator replays the same arrivals, with the prompt lengths the nodes reported, through the same
   scenario with the served profile on the shared host, the served profile with a processor per node, and
   the engine-only profile; predicted and measured p50/p99 go to docs/fleet.md.

    .venv/bin/python bench/fleet_calibrate.py [--rates 2 8] [--duration-s 60] [--repeat 2] [--write-docs]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
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
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from edgeinfer.bench.client import RequestSpec, build_payload, send_request
from edgeinfer.fleet.sim_demand import Arrivals, generate
from edgeinfer.fleet.sim_fleet import rtt_matrix
from edgeinfer.fleet.sim_host import HostSpec
from edgeinfer.fleet.sim_profile import load_profile, parse_profile
from edgeinfer.fleet.sim_run import build_locations, run_policy
from edgeinfer.fleet.sim_scenario import load_scenario
from edgeinfer.fleet.up import SITES

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(Path(__file__).parent))
from docs_table import replace_section  # noqa: E402
from fleet_profile import measure  # noqa: E402
from helpers.tiny_models import make_tiny  # noqa: E402

MODEL = "tiny"
# Large enough that the engine's own time is a fair part of a request's (a 128-token prefill ~10 ms, a step
# ~2 ms at one thread), so the node model is tested and not only serving's overheads; small enough that three
# nodes, three routers and the load generator fit on two cores at the load levels.
MODEL_SHAPE = dict(
    hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=4096,
)  # fmt: skip
ROLES = ("node", "router", "nats", "fleet", "client")
OUTSIDE_NODES = ("router", "nats", "fleet", "client")  # the work a scenario's [host] adds beside the nodes
IDLE_S = 5.0
WORDS = [f"w{i}" for i in range(2000)]
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
# The nodes serve the dtype the profile measures (bench/fleet_profile.py VARIANTS).
VARIANT = "bf16"
PROFILE_KEY = f"{MODEL}-{VARIANT}"
NODE_ARGS = ["--dtype", "bfloat16", "--threads", "1", "--max-num-seqs", "16", "--kv-cache-memory", "64MiB"]
NODE_ARGS += ["--memory-budget", "256MiB"]


def word_tokenizer(path: Path) -> PreTrainedTokenizerFast:
    """One token per word of WORDS: a prompt of n words is n tokens, and each generated token is a word
    (a byte-level vocabulary would stream partial UTF-8 as nothing, moving the measured first token later)."""
    vocab = {token: i for i, token in enumerate([*SPECIALS, *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    fast.save_pretrained(path)
    return fast


def scenario_for(profile_path: Path, rate: float, duration_s: float):
    """loopback-3.toml with the fleet-up sites, the tiny model's profile, and the given rate."""
    sc = load_scenario("loopback-3.toml")
    weights = {site["code"]: site["population"] for site in sc.locations.sites}
    sites = tuple(
        {"code": code, "lat": lat, "lon": lon, "population": weights.get(code, 1), "region": "EU"}
        for code, lat, lon in SITES[:3]
    )
    model = replace(sc.models[0], name=MODEL, profile=PROFILE_KEY)
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
    """`edgeinfer fleet up` as a child process; `urls` / `nodes` map location code -> router / node URL."""

    def __init__(self, model_dir: Path, workdir: Path) -> None:
        cmd = [sys.executable, "-m", "edgeinfer.cli", "fleet", "up", "--locations", "3", "--emulate-rtt"]
        cmd += ["--model", f"{MODEL}={model_dir}", "--workdir", str(workdir)]
        cmd += [f"--node-arg={a}" for a in NODE_ARGS]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, start_new_session=True)
        self.urls: dict[str, str] = {}
        self.nodes: dict[str, str] = {}
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        self.pids = {pid: _role(pid) for pid in _descendants(self.proc.pid)}
        found = sorted(self.pids.values())
        if found.count("node") != len(self.nodes) or found.count("router") != len(self.urls):
            raise RuntimeError(f"fleet up's processes were not told apart: {found}")
        self.idle = dict.fromkeys(ROLES, 0.0)  # cores each role burns with nothing in flight

    def cpu_s(self, roles: tuple[str, ...] = ROLES) -> float:
        """CPU seconds used so far by the fleet's processes of `roles` (ROLES: `client` is this load
        generator)."""
        own = time.process_time() if "client" in roles else 0.0
        return own + sum(_cpu_s(pid) for pid, role in self.pids.items() if role in roles)

    def _wait_ready(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            found = re.match(r"(\w{3})\s+router (\S+)\s+node (\S+)", line)
            if found:
                self.urls[found[1]], self.nodes[found[1]] = found[2], found[3]
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


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):  # a process that ended meanwhile
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])  # after "(comm)": state, ppid
            children.setdefault(ppid, []).append(int(stat.parent.name))
    found, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def _role(pid: int) -> str:
    """`node` (`python -m edgeinfer.node`), `router` (`edgeinfer.cli router`), `nats` (the server binary),
    or `fleet` (`fleet up` itself), by the command line `fleet up` started it with."""
    argv = [a.decode(errors="replace") for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")]
    if "edgeinfer.node" in argv:
        return "node"
    if "router" in argv:
        return "router"
    return "nats" if any("nats-server" in Path(a).name for a in argv) else "fleet"


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def scenario_rtt_s(profile_path: Path) -> float:
    """The RTT from the first site to itself (its last mile), as the simulator charges it."""
    sc = scenario_for(profile_path, 1.0, 1.0)
    return float(rtt_matrix(build_locations(sc), sc.network.path_inflation, sc.network.last_mile_ms)[0, 0])


def prompt_text(tokens: int, rng: random.Random) -> str:
    """Random words, one token each: no two prompts share a cacheable prefix."""
    return " ".join(rng.choice(WORDS) for _ in range(max(1, tokens)))


def payload_for(spec: RequestSpec, seed: int) -> dict:
    return {**build_payload("/v1/completions", MODEL, spec), "temperature": 1.0, "seed": seed}


async def replay(arrivals: Arrivals, codes: list[str], urls: dict[str, str], seed: int) -> list:
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=512)
    async with httpx.AsyncClient(timeout=120.0, limits=limits) as client:
        start = time.perf_counter()

        async def one(i: int):
            await asyncio.sleep(max(0.0, start + float(arrivals.time[i]) - time.perf_counter()))
            code = codes[int(arrivals.city[i])]
            spec = RequestSpec(prompt_text(int(arrivals.prompt[i]), rng), int(arrivals.output[i]), 0)
            payload = payload_for(spec, i)
            url = urls[code] + "/v1/completions"
            return await send_request(client, url, payload, spec, {"x-client-location": code})

        return await asyncio.gather(*(one(i) for i in range(len(arrivals))))


PROBE_PROMPT = 128
PROBE_GAP_S = 0.5


async def _probe(url: str, code: str, tokens: int, count: int) -> float:
    """Median end-to-end seconds of `count` requests (after one warm-up) of PROBE_PROMPT tokens and `tokens`
    output tokens, one at a time with PROBE_GAP_S between them: a request of the load levels finds its node
    idle for a while (its threads asleep), not just done with the previous one, and pays for the wake-up."""
    rng = random.Random(0)
    async with httpx.AsyncClient(timeout=60.0) as client:
        times = []
        for i in range(count + 1):
            spec = RequestSpec(prompt_text(PROBE_PROMPT, rng), tokens, 0)
            headers = {"x-client-location": code}
            record = await send_request(client, url + "/v1/completions", payload_for(spec, i), spec, headers)
            if not record.ok:
                raise RuntimeError(f"probe request failed: {record.error}")
            times.append(record.e2e)
            await asyncio.sleep(PROBE_GAP_S)
        return float(np.median(times[1:]))


def _cpu_by_role(fleet: LoopbackFleet) -> dict[str, float]:
    return {role: fleet.cpu_s((role,)) for role in ROLES}


def _probe_with_cpu(
    fleet: LoopbackFleet, url: str, tokens: int, count: int
) -> tuple[float, dict[str, float]]:
    """`_probe`'s median, and the CPU seconds each role spent during it, per request."""
    before, started = _cpu_by_role(fleet), time.perf_counter()
    median = asyncio.run(_probe(url, SITES[0][0], tokens, count))
    elapsed, after = time.perf_counter() - started, _cpu_by_role(fleet)
    return median, {r: (after[r] - before[r] - fleet.idle[r] * elapsed) / (count + 1) for r in ROLES}


def measure_idle(fleet: LoopbackFleet) -> None:
    """CPU cores each role burns with no request in flight (heartbeats, status, NATS): `fleet.idle`."""
    before, started = _cpu_by_role(fleet), time.perf_counter()
    time.sleep(IDLE_S)
    elapsed, after = time.perf_counter() - started, _cpu_by_role(fleet)
    fleet.idle = {r: (after[r] - before[r]) / elapsed for r in ROLES}


def served_profile(fleet: LoopbackFleet, profile: dict, rtt_s: float, count: int = 20) -> dict:
    """The engine profile plus what serving adds on an idle fleet, from sequential one-token and 65-token
    requests to a node directly and through its router (before and apart from the load levels):
    the node's extra time for a one-token request is a per-request cost on the node's clock, the router's
    extra time over the node's (less the emulated RTT) its hop, and the routed stream's extra time per further
    token a per-stream cost of every decode step. The routed probes' CPU time outside the nodes (routers,
    NATS, this client), less what those burn idle, gives the host's per-request and per-token work."""
    code = SITES[0][0]
    entry = profile["models"][PROFILE_KEY]
    engine = parse_profile(profile).model(PROFILE_KEY)
    measure_idle(fleet)
    node_one = asyncio.run(_probe(fleet.nodes[code], code, 1, count))
    routed_one, cpu_one = _probe_with_cpu(fleet, fleet.urls[code], 1, count)
    routed_long, cpu_long = _probe_with_cpu(fleet, fleet.urls[code], 65, count)
    request_s = node_one - engine.prefill_s(PROBE_PROMPT)
    router_s = routed_one - node_one - rtt_s
    token_s = (routed_long - routed_one) / 64 - engine.step_s(1, PROBE_PROMPT + 32)
    serving = {name: round(1000 * max(0.0, float(v)), 3) for name, v in
               (("request_ms", request_s), ("router_ms", router_s), ("per_token_ms", token_s))}  # fmt: skip
    outside_one = sum(cpu_one[r] for r in OUTSIDE_NODES)
    token_cpu = (sum(cpu_long[r] for r in OUTSIDE_NODES) - outside_one) / 64
    host = {
        "cores": float(os.cpu_count() or 1),
        "idle_cores": round(sum(fleet.idle.values()), 4),
        "request_cpu_ms": round(1000 * max(0.0, outside_one - token_cpu), 3),
        "token_cpu_ms": round(1000 * max(0.0, token_cpu), 3),
    }
    # what the nodes themselves burn, to set beside the time the served profile charges them
    node_cpu = {"request_ms": round(1000 * cpu_one["node"], 3),
                "per_token_ms": round(1000 * (cpu_long["node"] - cpu_one["node"]) / 64, 3)}  # fmt: skip
    served = {
        **entry,
        "request_overhead_ms": serving["request_ms"],
        "step_per_seq_ms": round(entry["step_per_seq_ms"] + serving["per_token_ms"], 3),
    }
    return {
        **profile,
        "models": {PROFILE_KEY: served},
        "serving": serving,
        "host": host,
        "node_cpu": node_cpu,
    }


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


def scenario_with(sc, path: Path, label: str):
    """`sc` predicted with the profile at `path`: `engine` alone; `served` adds serving's costs and the
    router's hop; `host` also puts the nodes on this machine's cores beside the routers' and client's work."""
    sc = replace(sc, base_dir=path.parent, nodes=replace(sc.nodes, profile=path.name))
    if label == "engine":
        return sc
    served = json.loads(path.read_text())
    sc = replace(sc, network=replace(sc.network, router_ms=served["serving"]["router_ms"]))
    return replace(sc, host=HostSpec(**served["host"])) if label == "host" else sc


def one_level(
    fleet: LoopbackFleet, profiles: dict[str, Path], rate: float, duration_s: float, seed: int
) -> dict:
    """Replay one load level; predict it with each profile (`served`, `engine`)."""
    sc = replace(scenario_for(profiles["served"], rate, duration_s), seed=seed)
    locations = build_locations(sc)
    arrivals = generate(sc, locations, np.random.default_rng(seed))
    codes = [loc.code for loc in locations]
    load_before, cpu_before, started = os.getloadavg()[0], fleet.cpu_s(), time.perf_counter()
    records = asyncio.run(replay(arrivals, codes, fleet.urls, seed))
    cores = (fleet.cpu_s() - cpu_before) / (time.perf_counter() - started)
    load_after = os.getloadavg()[0]
    replayed, ok = measured_arrivals(arrivals, records)
    row = {"rate": rate, "seed": seed, "requests": len(arrivals), "failed": int((~ok).sum())}
    row["errors"] = sorted({r.error[:120] for r in records if not r.ok})[:3]
    real = {
        "ttft": np.array([r.ttft if r.ok else np.nan for r in records]),
        "e2e": np.array([r.e2e if r.ok else np.nan for r in records]),
    }
    for name, real_values in real.items():
        for q in (50, 99):
            row[f"{name}_p{q}_measured"] = pct(real_values, q)
    for label, path in (("host", profiles["served"]), *profiles.items()):
        rec = run_policy(
            scenario_with(sc, path, label), load_profile(path), locations, replayed, "router", progress=False
        ).fleet.records
        for name, sim in (("ttft", rec.ttft), ("e2e", rec.e2e)):
            for q in (50, 99):
                row[f"{name}_p{q}_{label}"] = pct(sim[ok], q)
    row["load"] = (load_before, load_after)
    row["cores"] = cores
    return row


def table(rows: list[dict], profile: dict, served: dict, args: argparse.Namespace) -> str:
    entry = profile["models"][PROFILE_KEY]
    clock = profile["source"].split(", ", 1)[1]
    serving, host, node_cpu = served["serving"], served["host"], served["node_cpu"]
    rates = " ".join(f"{r:g}" for r in args.rates)
    lines = [
        "### Calibration: loopback fleet vs simulator",
        "",
        f"Machine: {profile['device']}; engine profile of the calibration Llama (hidden "
        f"{MODEL_SHAPE['hidden_size']}, {MODEL_SHAPE['num_hidden_layers']} layers, {VARIANT}; {clock}, one "
        "thread): prefill "
        f"{entry['prefill_tok_s']:.0f} tok/s + {entry['prefill_overhead_ms']:.2f} ms, step "
        f"{entry['step_base_ms']:.3f} + {entry['step_per_seq_ms']:.3f} × batch + "
        f"{entry['step_per_kctx_ms']:.3f} × kctx ms. Serving on the idle fleet added "
        f"{serving['request_ms']:.1f} ms a request on the node, {serving['per_token_ms']:.2f} ms a token "
        f"and stream, and {serving['router_ms']:.1f} ms for the router's hop (the `served` profile adds "
        f"them). CPU on the idle fleet: {host['idle_cores']:.2f} cores with nothing in flight; outside the "
        f"nodes (routers, NATS, this client) {host['request_cpu_ms']:.1f} ms a request and "
        f"{host['token_cpu_ms']:.2f} ms a streamed token (the nodes themselves: {node_cpu['request_ms']:.1f} "
        f"ms and {node_cpu['per_token_ms']:.2f} ms); `[host]` puts the nodes on the {host['cores']:g} cores "
        "beside that work.",
        f"Command: `.venv/bin/python bench/fleet_calibrate.py --rates {rates} "
        f"--duration-s {args.duration_s:g} --repeat {args.repeat} --write-docs`",
        "",
        "ms, measured / predicted with the served profile on the shared host; "
        "error = predicted / measured − 1. "
        "The next columns predict p50 TTFT / E2E with a processor per node (the served profile without "
        "`[host]`) and with the engine-only profile.",
        "",
        "| req/s | run | requests | TTFT p50 | TTFT p99 | E2E p50 | E2E p99 | p50 error TTFT, E2E "
        "| a processor per node: p50 TTFT / E2E (error) | engine-only p50 TTFT / E2E "
        "| fleet CPU | load avg |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(rows):

        def pair(name: str, r: dict = r) -> str:
            return f"{r[name + '_measured']:.0f} / {r[name + '_host']:.0f}"

        def err(name: str, label: str = "host", r: dict = r) -> str:
            return f"{100 * (r[f'{name}_{label}'] / r[name + '_measured'] - 1):+.0f} %"

        lines.append(
            f"| {r['rate']:g} | {i % args.repeat + 1} | {r['requests']} ({r['failed']} failed) "
            f"| {pair('ttft_p50')} | {pair('ttft_p99')} | {pair('e2e_p50')} | {pair('e2e_p99')} "
            f"| {err('ttft_p50')}, {err('e2e_p50')} | {r['ttft_p50_served']:.0f} / {r['e2e_p50_served']:.0f} "
            f"({err('ttft_p50', 'served')}, {err('e2e_p50', 'served')}) "
            f"| {r['ttft_p50_engine']:.0f} / {r['e2e_p50_engine']:.0f} "
            f"| {r['cores']:.2f} of {os.cpu_count()} cores | {r['load'][0]:.1f} → {r['load'][1]:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", type=float, nargs="+", default=[2.0, 8.0])
    ap.add_argument("--duration-s", type=float, default=60.0)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--write-docs", action="store_true")
    ap.add_argument("--wall-clock-profile", action="store_true", help="profile by wall clock, not CPU time")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="fleet-calibrate-") as tmp:
        work = Path(tmp)
        model_dir = make_tiny("llama", work / "tiny", tokenizer_builder=word_tokenizer, **MODEL_SHAPE)
        profile = measure(MODEL, str(model_dir), [VARIANT], wall=args.wall_clock_profile)
        profile_path = work / "profile.json"
        profile_path.write_text(json.dumps(profile))
        fleet = LoopbackFleet(model_dir, work / "fleet")
        rows = []
        try:
            rtt_s = scenario_rtt_s(profile_path)
            served = served_profile(fleet, profile, rtt_s)
            served_path = work / "served" / "profile.json"
            served_path.parent.mkdir()
            served_path.write_text(json.dumps(served))
            print("serving adds (ms):", served["serving"], flush=True)
            profiles = {"served": served_path, "engine": profile_path}
            for rate in args.rates:
                for rep in range(args.repeat):
                    rows.append(one_level(fleet, profiles, rate, args.duration_s, seed=1 + rep))
                    print(json.dumps(rows[-1]), flush=True)
        finally:
            fleet.stop()
    body = table(rows, profile, served, args)
    print(body)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    if args.write_docs:
        replace_section(ROOT / "docs/fleet.md", "fleet-calibration", body)


if __name__ == "__main__":
    main()

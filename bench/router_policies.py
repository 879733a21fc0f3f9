"""Routing policies on a 3-location loopback fleet with `--emulate-rtt` and skewed demand: the router's
TTFT ranking (`--strategy ttft`) against the `nearest` and `least-loaded` baselines.

NATS, one node process per location (FRA, AMS, LHR; a tiny random Llama, two sequence slots each) and one
router per strategy (all at FRA, all emulating the fleet file's RTTs) run on loopback. The FRA node's
throughput is measured first; then each router gets the same open-loop Poisson demand at `--load` times
that throughput, `--skew` of it from FRA clients and the rest split between AMS and LHR, so FRA alone is
oversubscribed while the fleet has room. Strategies take turns for `--rounds` rounds.

    python bench/router_policies.py [--seconds 25] [--rounds 2] [--write docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "bench")]
from docs_table import replace_section  # noqa: E402
from helpers.tiny_models import make_tiny  # noqa: E402

from edgeinfer.fleet.nats_server import start_nats  # noqa: E402

SECTION = "router-policies"
STRATEGIES = ("ttft", "nearest", "least-loaded")
LOCATIONS = (("FRA", 50.03, 8.57), ("AMS", 52.31, 4.76), ("LHR", 51.47, -0.45))
RTT_MS = {"FRA-AMS": 20.0, "FRA-LHR": 30.0, "AMS-LHR": 16.0}  # emulated round trips
MAX_TOKENS = 24
ROUTER_FLAGS = ["--busy-queue-depth", "4", "--stale-after-s", "2", "--drop-after-s", "10", "--seed", "0"]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def fleet_toml(node_ports: dict[str, int]) -> str:
    lines = []
    for code, lat, lon in LOCATIONS:
        lines += ["[[locations]]", f'code = "{code}"', f"lat = {lat}", f"lon = {lon}"]
        lines += [
            "[[locations.nodes]]",
            f'id = "{code.lower()}-1"',
            f'url = "http://127.0.0.1:{node_ports[code]}"',
        ]
    lines += ["[rtt_ms]", *(f'"{pair}" = {ms}' for pair, ms in RTT_MS.items())]
    return "\n".join(lines) + "\n"


class Processes:
    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.procs: list[subprocess.Popen[bytes]] = []

    def spawn(self, name: str, args: list[str]) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
        log = (self.workdir / f"{name}.log").open("wb")
        self.procs.append(subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env))

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.terminate()
        for p in reversed(self.procs):
            p.wait(30)


def wait_ready(urls: list[str], timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    for url in urls:
        while True:
            try:
                if httpx.get(url + "/ready", timeout=2.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} not ready")
            time.sleep(0.3)


@dataclass
class Result:
    ttfts: list[float] = field(default_factory=list)  # seconds, answered requests
    rejected: int = 0  # 429 from the router (every candidate busy)
    failed: int = 0  # anything else
    served: Counter[str] = field(default_factory=Counter)  # (client location -> node) pairs


async def one(client: httpx.AsyncClient, url: str, location: str, result: Result) -> None:
    body = {"model": "tiny", "prompt": "Hello there", "max_tokens": MAX_TOKENS, "ignore_eos": True}
    headers = {"x-client-location": location}
    start = time.perf_counter()
    try:
        async with client.stream("POST", url, json={**body, "stream": True}, headers=headers) as response:
            if response.status_code == 429:
                result.rejected += 1
                return
            if response.status_code != 200:
                result.failed += 1
                return
            first = None
            async for _ in response.aiter_raw():
                if first is None:
                    first = time.perf_counter() - start
        result.ttfts.append(first or 0.0)
        result.served[f"{location}->{response.headers.get('x-edgeinfer-node', '?')}"] += 1
    except httpx.HTTPError:
        result.failed += 1


async def open_loop(url: str, rate: float, seconds: float, skew: float, seed: int) -> Result:
    """Poisson arrivals at `rate`/s for `seconds`; a client is in FRA with probability `skew`."""
    rng = random.Random(seed)
    result = Result()
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=256)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        tasks = []
        t_end = time.perf_counter() + seconds
        next_at = time.perf_counter()
        while next_at < t_end:
            await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
            location = "FRA" if rng.random() < skew else rng.choice(("AMS", "LHR"))
            tasks.append(asyncio.create_task(one(client, url + "/v1/completions", location, result)))
            next_at += rng.expovariate(rate)
        await asyncio.gather(*tasks)
    return result


async def node_throughput(url: str, seconds: float = 6.0) -> float:
    """Requests/s of one node kept full (two streams at a time, its two slots)."""
    done = 0
    async with httpx.AsyncClient(timeout=60) as client:
        body = {"model": "tiny", "prompt": "Hello there", "max_tokens": MAX_TOKENS, "ignore_eos": True}
        t_end = time.perf_counter() + seconds

        async def loop() -> None:
            nonlocal done
            while time.perf_counter() < t_end:
                (await client.post(url + "/v1/completions", json=body)).raise_for_status()
                done += 1

        start = time.perf_counter()
        await asyncio.gather(loop(), loop())
        return done / (time.perf_counter() - start)


def pct(values: list[float], q: int) -> float:
    if len(values) < 2:
        return float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] * 1000


def start_fleet(procs: Processes, tmp: Path) -> tuple[dict[str, str], float]:
    model = make_tiny("llama", tmp / "tiny", max_position_embeddings=512)
    nats_port = free_port()
    nats = start_nats(nats_port, tmp / "nats.log")
    procs.procs.append(nats)
    nats_url = f"nats://127.0.0.1:{nats_port}"
    node_ports = {code: free_port() for code, _, _ in LOCATIONS}
    (tmp / "fleet.toml").write_text(fleet_toml(node_ports))
    py = [sys.executable, "-m", "edgeinfer.cli"]
    for code, port in node_ports.items():
        procs.spawn(
            f"node-{code}",
            [*py, "serve", "--port", str(port), "--model", f"tiny={model}", "--preload"]
            + ["--node-id", f"{code.lower()}-1", "--location", code, "--nats-url", nats_url]
            + ["--dtype", "float32", "--max-num-seqs", "2", "--batch-window-ms", "0", "--no-access-log"]
            + ["--usage-db", str(tmp / f"{code}.sqlite"), "--threads", "1"],
        )
    wait_ready([f"http://127.0.0.1:{p}" for p in node_ports.values()])
    capacity = asyncio.run(node_throughput(f"http://127.0.0.1:{node_ports['FRA']}"))
    # The policy's queue-wait estimate needs the time a request holds a slot: two slots, `capacity`/s.
    service_time = f"{2 / capacity:.3f}"
    routers = {}
    for strategy in STRATEGIES:
        port = free_port()
        procs.spawn(
            f"router-{strategy}",
            [*py, "router", "--fleet", str(tmp / "fleet.toml"), "--location", "FRA", "--port", str(port)]
            + ["--nats-url", nats_url, "--strategy", strategy, "--emulate-rtt", *ROUTER_FLAGS]
            + ["--service-time-s", service_time],
        )
        routers[strategy] = f"http://127.0.0.1:{port}"
    wait_ready(list(routers.values()))
    for url in routers.values():  # warm every router's connections and code paths at a light load
        asyncio.run(open_loop(url, capacity / 2, 3.0, 0.8, seed=99))
    return routers, capacity


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=25.0, help="demand per strategy and round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--skew", type=float, default=0.8, help="share of the demand from FRA clients")
    parser.add_argument("--load", type=float, default=1.5, help="demand / one node's throughput")
    parser.add_argument("--write", default=None, help="replace this file's router-policies section")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="router-policies-"))
    load_before = os.getloadavg()[0]
    procs = Processes(tmp)
    results = {s: Result() for s in STRATEGIES}
    try:
        routers, capacity = start_fleet(procs, tmp)
        rate = args.load * capacity
        for r in range(args.rounds):
            for strategy in STRATEGIES if r % 2 == 0 else reversed(STRATEGIES):
                got = asyncio.run(open_loop(routers[strategy], rate, args.seconds, args.skew, seed=r))
                into = results[strategy]
                into.ttfts += got.ttfts
                into.rejected += got.rejected
                into.failed += got.failed
                into.served.update(got.served)
                print(strategy, r, len(got.ttfts), got.rejected, got.failed, flush=True)
    finally:
        procs.stop()
    report = render(args, results, capacity, rate, load_before, os.getloadavg()[0])
    print(report)
    if args.write:
        replace_section(Path(args.write), SECTION, report)
    return 0


def render(
    args: argparse.Namespace,
    results: dict[str, Result],
    capacity: float,
    rate: float,
    load_before: float,
    load_after: float,
) -> str:
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    rows = []
    for strategy, res in results.items():
        total = len(res.ttfts) + res.rejected + res.failed
        fra = sum(n for key, n in res.served.items() if key.startswith("FRA->") and not key.endswith("fra-1"))
        fra_total = sum(n for key, n in res.served.items() if key.startswith("FRA->"))
        rows.append(
            f"| `{strategy}` | {total} | {len(res.ttfts)} "
            f"| {res.rejected} ({100 * res.rejected / max(1, total):.1f} %)"
            f" | {res.failed} | {pct(res.ttfts, 50):.0f} / {pct(res.ttfts, 99):.0f} "
            f"| {100 * fra / max(1, fra_total):.0f} % |"
        )
    rtts = ", ".join(f"{k} {v:.0f} ms" for k, v in RTT_MS.items())
    return "\n".join(
        [
            "### Router: policy comparison on a 3-location loopback fleet (`--emulate-rtt`, skewed demand)",
            "",
            f"Machine: {cpu}, {os.cpu_count()} CPUs, Python {platform.python_version()}; 1-min load average "
            f"{load_before:.1f} before, {load_after:.1f} after (shared machine: compare rows, not runs). "
            "NATS, one node process per location (FRA, AMS, LHR; tiny random Llama, fp32, "
            "`--max-num-seqs 2`, `--threads 1`) and one router per strategy, all at FRA with `--emulate-rtt` "
            f"(RTTs {rtts}) and `{' '.join(ROUTER_FLAGS)}`. One node's throughput measured first: "
            f"{capacity:.1f} requests/s, so `--service-time-s {2 / capacity:.3f}` (two slots); demand: "
            f"open-loop Poisson at {args.load}× that ({rate:.1f}/s), "
            f"{100 * args.skew:.0f} % from FRA clients, the rest split between AMS and LHR; streamed "
            f"completions of {MAX_TOKENS} tokens. {args.rounds} rounds of {args.seconds:.0f} s per strategy, "
            "strategies taking turns (order reversed each round) after 3 s of light warm-up each. "
            "TTFT = request sent to the first body byte at the client (emulated RTT "
            "included); rejected = the router's 429 (every candidate over `--busy-queue-depth`).",
            f"Command: `python bench/router_policies.py --seconds {args.seconds:g} --rounds {args.rounds} "
            f"--load {args.load:g} --skew {args.skew:g} --write docs/benchmarks.md`",
            "",
            "| strategy | requests | answered | rejected | failed | TTFT p50 / p99 ms "
            "| FRA clients sent away |",
            "|---|---|---|---|---|---|---|",
            *rows,
        ]
    )


if __name__ == "__main__":
    raise SystemExit(main())

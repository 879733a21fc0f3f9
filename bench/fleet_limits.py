"""Fleet limits (router/limits/): what a decision costs and how close to the limit the fleet stays.

R routers (1, 3, 8), each a `FleetLimiter` on its own NATS connection to one nats-server with JetStream
(on loopback, in this process), admit one tenant's requests, offered at several times its limit and spread
evenly over the routers. Measured: the time `admit` takes per request (p50 / p99; most are answered from
the router's lease, every slice'th pays a round trip to the bucket), and the most any window admitted,
fleet-wide, against the limit. The peer in the same run is the plain design the leases replace: one
compare-and-set on a shared counter in the same bucket for every request.

    .venv/bin/python bench/fleet_limits.py [--windows 4] [--window-s 2] [--limit 300] [--write-docs]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import nats

from edgeinfer.api.errors import ApiError
from edgeinfer.api.tenants import Tenant, TenantLimits
from edgeinfer.fleet.nats_server import start_nats
from edgeinfer.router.limits.limiter import FleetLimiter, FleetLimitsConfig
from edgeinfer.router.limits.store import WINDOWS_BUCKET, StoreUnavailable, change, open_bucket, take_units
from edgeinfer.router.metrics import RouterMetrics

sys.path.insert(0, str(Path(__file__).parent))
from docs_table import replace_section
from peers import cpu_flags, cpuinfo_field

ROUTERS = (1, 3, 8)
OFFERED = 3  # requests offered per window, in multiples of the limit
DOCS = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"
NATS_PORT = 4591


async def leased(url: str, routers: int, args: argparse.Namespace) -> dict[str, float]:
    config = FleetLimitsConfig(window_s=args.window_s)
    connections = [await nats.connect(url) for _ in range(routers)]
    limiters = [
        FleetLimiter(
            nc.jetstream(), f"r{i}", config, RouterMetrics(lambda: []), lambda nc=nc: nc.is_connected
        )
        for i, nc in enumerate(connections)
    ]
    for limiter in limiters:
        await limiter.start()
    tenant = Tenant(
        name=f"t{routers}", cache_namespace="ns", limits=TenantLimits(requests_per_minute=args.limit)
    )
    latencies: list[tuple[float, bool]] = []
    per_window: Counter[int] = Counter()

    async def one(limiter: FleetLimiter, n: int) -> None:
        t0 = time.perf_counter()
        try:
            admission = await limiter.admit(tenant, f"{routers}-{n}", 0)
        except ApiError:
            admission = None
        latencies.append((time.perf_counter() - t0, admission is not None))
        if admission is not None:
            per_window[admission.window] += 1
            admission.end(200)

    await _paced(limiters, one, args)
    for limiter in limiters:
        await limiter.stop()
    for nc in connections:
        await nc.close()
    return _summary(latencies, per_window, args.limit) | {"failed": 0.0}


async def per_request_cas(url: str, routers: int, args: argparse.Namespace) -> dict[str, float]:
    """The peer: every request takes one unit from the shared counter by compare-and-set."""
    connections = [await nats.connect(url) for _ in range(routers)]
    buckets = [await open_bucket(nc.jetstream(), WINDOWS_BUCKET, 3 * args.window_s) for nc in connections]
    latencies: list[tuple[float, bool]] = []
    per_window: Counter[int] = Counter()
    failed: list[int] = []

    async def one(kv: object, n: int) -> None:
        t0 = time.perf_counter()
        window = int(time.time() // args.window_s)
        try:
            granted = await change(kv, f"peer{routers}.requests.{window}", take_units(1, args.limit))
        except StoreUnavailable:  # lost the compare-and-set too often in a row: an error for the client
            failed.append(n)
            granted = 0
        latencies.append((time.perf_counter() - t0, granted > 0))
        per_window[window] += granted

    await _paced(buckets, one, args)
    for nc in connections:
        await nc.close()
    return _summary(latencies, per_window, args.limit) | {"failed": len(failed) / len(latencies)}


async def _paced(targets: list, one, args: argparse.Namespace) -> None:
    """OFFERED x limit requests per window, evenly in time and across the targets, for `windows` windows
    (starting at a window's start)."""
    await asyncio.sleep(args.window_s - time.time() % args.window_s)
    total = OFFERED * args.limit * args.windows
    gap = args.window_s / (OFFERED * args.limit)
    start = time.perf_counter()
    tasks = []
    for n in range(total):
        await asyncio.sleep(max(0.0, start + n * gap - time.perf_counter()))
        tasks.append(asyncio.create_task(one(targets[n % len(targets)], n)))
    await asyncio.gather(*tasks)


def _summary(latencies: list[tuple[float, bool]], per_window: Counter[int], limit: int) -> dict[str, float]:
    whole = [per_window[w] for w in sorted(per_window)[1:-1]] or list(per_window.values())
    return {
        **_percentiles("admitted", [t for t, ok in latencies if ok]),
        **_percentiles("refused", [t for t, ok in latencies if not ok]),
        "max_ratio": max(per_window.values()) / limit,
        "mean_ratio": statistics.fmean(whole) / limit,
    }


def _percentiles(name: str, seconds: list[float]) -> dict[str, float]:
    ms = sorted(x * 1e3 for x in seconds) or [float("nan")]
    return {f"{name}_p50": statistics.median(ms), f"{name}_p99": ms[int(0.99 * (len(ms) - 1))]}


def table(rows: list[tuple[int, str, dict[str, float]]], args: argparse.Namespace) -> str:
    flags = " ".join(sorted(cpu_flags() & {"avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile"}))
    head = [
        "### Fleet limits: decision time and accuracy",
        "",
        f"Machine: {cpuinfo_field('model name') or 'unknown CPU'} ({flags}); nats-server with JetStream on "
        "loopback, every router's limiter in one Python process, each on its own NATS connection.",
        f"Workload: one tenant limited to {args.limit} requests per {args.window_s:g} s window, offered "
        f"{OFFERED}x that, evenly over the routers, for {args.windows} windows. Ours: leases of 5 % of the "
        "limit (`FleetLimiter`); the peer: one compare-and-set on the shared counter per request.",
        f"Command: `.venv/bin/python bench/fleet_limits.py --windows {args.windows} "
        f"--window-s {args.window_s:g} --limit {args.limit} --write-docs`",
        "",
        "| routers | design | admitted: p50 / p99 ms | refused: p50 / p99 ms "
        "| most admitted in a window ÷ limit | mean over whole windows ÷ limit "
        "| requests failed (store contention) |",
        "|---|---|---|---|---|---|---|",
    ]
    for routers, design, r in rows:
        head.append(
            f"| {routers} | {design} | {r['admitted_p50']:.3f} / {r['admitted_p99']:.3f} | "
            f"{r['refused_p50']:.3f} / {r['refused_p99']:.3f} | {r['max_ratio']:.3f} | "
            f"{r['mean_ratio']:.3f} | {r['failed']:.1%} |"
        )
    return "\n".join(head)


async def main_async(args: argparse.Namespace) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        proc = start_nats(NATS_PORT, Path(tmp) / "nats.log", Path(tmp) / "js")
        try:
            rows = []
            for routers in ROUTERS:
                url = f"nats://127.0.0.1:{NATS_PORT}"
                rows.append((routers, "leases (ours)", await leased(url, routers, args)))
                rows.append((routers, "CAS per request", await per_request_cas(url, routers, args)))
                print(rows[-2], rows[-1], flush=True)
        finally:
            proc.terminate()
            proc.wait(10)
    return table(rows, args)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--window-s", type=float, default=2.0)
    ap.add_argument("--limit", type=int, default=300)
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args()
    text = asyncio.run(main_async(args))
    print(text)
    if args.write_docs:
        replace_section(DOCS, "fleet-limits", text)


if __name__ == "__main__":
    main()

"""Router added latency: TTFT through `edgeinfer router` and through `sglang-router` (both pinned to one
core) minus TTFT straight to the same stub node, at 1, 64 and 256 concurrent streams; and requests/s.

    python bench/router_latency.py [--write docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from docs_table import replace_section  # noqa: E402

SECTION = "router-latency"
LEVELS = ((1, 60), (64, 384), (256, 1024))  # (concurrency, requests)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn(cmd: list[str], cpu: str | None, log: Path) -> subprocess.Popen[bytes]:
    prefix = ["taskset", "-c", cpu] if cpu is not None else []
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    return subprocess.Popen(prefix + cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env)


def wait_up(url: str, path: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + path, timeout=1.0).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not come up")


async def one(client: httpx.AsyncClient, url: str) -> float | None:
    """TTFT in seconds; None for an answer other than 200."""
    body = {"model": "stub", "prompt": "hi", "max_tokens": 16, "stream": True}
    start = time.perf_counter()
    ttft = None
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as response:
            if response.status_code != 200:
                return None
            async for _ in response.aiter_raw():
                if ttft is None:
                    ttft = time.perf_counter() - start
    except httpx.HTTPError:
        return None
    return ttft


async def load(url: str, concurrency: int, total: int) -> tuple[list[float], float, int]:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        await asyncio.gather(*(one(client, url) for _ in range(min(concurrency, 16))))  # warm connections
        queue = list(range(total))
        ttfts: list[float] = []
        failed = 0

        async def worker() -> None:
            nonlocal failed
            while queue:
                queue.pop()
                ttft = await one(client, url)
                if ttft is None:
                    failed += 1
                else:
                    ttfts.append(ttft)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return ttfts, total / (time.perf_counter() - start), failed


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1] * 1000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", default=None, help="replace this file's router-latency section")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="router-bench-"))
    stub_port, ours_port, sgl_port = free_port(), free_port(), free_port()
    stub_url = f"http://127.0.0.1:{stub_port}"
    fleet = tmp / "fleet.toml"
    fleet.write_text(
        f'[[locations]]\ncode = "FRA"\nlat = 50.0\nlon = 8.5\n'
        f'[[locations.nodes]]\nid = "stub"\nurl = "{stub_url}"\n'
    )
    load_before = os.getloadavg()[0]
    procs = [
        spawn([sys.executable, str(ROOT / "bench/router_stub.py"), str(stub_port)], "1", tmp / "stub.log")
    ]
    try:
        wait_up(stub_url, "/health")
        procs.append(
            spawn(
                [
                    sys.executable,
                    "-m",
                    "edgeinfer.cli",
                    "router",
                    "--fleet",
                    str(fleet),
                    "--location",
                    "FRA",
                    "--port",
                    str(ours_port),
                    "--stale-after-s",
                    "5",
                ],
                "0",
                tmp / "ours.log",
            )
        )
        procs.append(
            spawn(
                [
                    sys.executable,
                    "-m",
                    "sglang_router.launch_router",
                    "--worker-urls",
                    stub_url,
                    "--port",
                    str(sgl_port),
                    "--policy",
                    "round_robin",
                    "--log-level",
                    "warn",
                ],
                "0",
                tmp / "sglang.log",
            )
        )
        wait_up(f"http://127.0.0.1:{ours_port}", "/ready")
        wait_up(f"http://127.0.0.1:{sgl_port}", "/health")
        targets = {
            "direct": stub_url,
            "edgeinfer router": f"http://127.0.0.1:{ours_port}",
            "sglang-router": f"http://127.0.0.1:{sgl_port}",
        }
        rows = []
        for concurrency, total in LEVELS:
            results = {name: asyncio.run(load(url, concurrency, total)) for name, url in targets.items()}
            base = results["direct"][0]
            for name, (ttfts, rate, failed) in results.items():
                added = (
                    ""
                    if name == "direct"
                    else (f"{pct(ttfts, 50) - pct(base, 50):+.2f} / {pct(ttfts, 99) - pct(base, 99):+.2f}")
                )
                rows.append(
                    f"| {name} | {concurrency} | {total - failed}/{failed} | {pct(ttfts, 50):.2f} / "
                    f"{pct(ttfts, 99):.2f} "
                    f"| {added} | {rate:.0f} |"
                )
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(20)
    report = render(rows, load_before, os.getloadavg()[0])
    print(report)
    if args.write:
        replace_section(Path(args.write), SECTION, report)
    return 0


def render(rows: list[str], load_before: float, load_after: float) -> str:
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    sgl = subprocess.run(
        [sys.executable, "-m", "pip", "show", "sglang-router"], capture_output=True, text=True
    )
    version = next((line.split()[1] for line in sgl.stdout.splitlines() if line.startswith("Version")), "?")
    return "\n".join(
        [
            "### Router: added latency (edgeinfer router vs sglang-router)",
            "",
            f"Machine: {cpu}, {os.cpu_count()} CPUs, Python {platform.python_version()}; 1-min load "
            f"average {load_before:.1f} before, {load_after:.1f} after (other work shares this machine: "
            "compare rows, not runs). Both routers pinned to CPU 0 (`taskset -c 0`), the stub node to CPU 1; "
            "the load generator (httpx) is not pinned. Stub: streams 16 SSE chunks, the first at once, then "
            f"one per 10 ms. sglang-router {version} (`--policy round_robin`); edgeinfer router polling the "
            "stub's /node/status, `--stale-after-s 5`. TTFT = request sent to first body byte; added = "
            "through the router minus direct, same concurrency.",
            "Command: `python bench/router_latency.py --write docs/benchmarks.md`",
            "",
            "| target | concurrency | ok/failed | TTFT p50 / p99 ms | added p50 / p99 ms | requests/s |",
            "|---|---|---|---|---|---|",
            *rows,
        ]
    )


if __name__ == "__main__":
    raise SystemExit(main())

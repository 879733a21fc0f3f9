"""The batch lane against interactive work, on one node serving the default model at its default threads:

1. idle: a batch of queued requests (the Batch API) alone: the node's batch throughput when nobody else
   asks (output tokens/s);
2. interactive alone: streamed requests arriving at random (Poisson, fixed seed), time to first token;
3. both: the same interactive arrivals while a larger batch keeps the node busy: interactive TTFT against
   (2) (target <= 1.2x), and the batch's throughput against the spare capacity the interactive load
   leaves, idle throughput minus the interactive output rate (target >= 80 %).

Fresh random prompts everywhere, so no prefix cache helps either side.

    .venv/bin/python bench/batch_lane.py [--rate 0.5] [--write-docs]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "src"), str(REPO / "bench")]
import peers  # noqa: E402
from docs_table import replace_section  # noqa: E402
from serve_vs_llamacpp import our_server  # noqa: E402

from edgeinfer.fleet.nats_server import start_nats  # noqa: E402

DOCS = REPO / "docs" / "benchmarks.md"
MODEL = "gemma-3-270m"
RUN = f"/accounts/bench/ai/run/{MODEL}"
PORT, NATS_PORT = 8573, 8574
WORDS = ("river", "stone", "light", "paper", "cloud", "garden", "window", "music", "silver", "market")
PROMPT_WORDS, INTERACTIVE_TOKENS, BATCH_TOKENS = 96, 24, 64


def prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(PROMPT_WORDS))


def entry(rng: random.Random) -> dict[str, object]:
    return {"prompt": prompt(rng), "raw": True, "max_tokens": BATCH_TOKENS, "temperature": 0}


@dataclass
class Interactive:
    ttfts: list[float]
    output_tokens: int


async def one_interactive(client: httpx.AsyncClient, text: str) -> tuple[float, int]:
    body = {
        "model": MODEL,
        "prompt": text,
        "max_tokens": INTERACTIVE_TOKENS,
        "temperature": 0,
        "stream": True,
    }
    body["stream_options"] = {"include_usage": True}
    t0 = time.perf_counter()
    first, tokens = 0.0, 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {") and not first:
                first = time.perf_counter() - t0
            if '"usage"' in line and '"completion_tokens"' in line:
                tokens = int(line.split('"completion_tokens":')[1].split(",")[0].split("}")[0])
    return first, tokens


async def interactive_load(
    client: httpx.AsyncClient, n: int, rate: float, seed: int, prompt_seed: int
) -> Interactive:
    """`n` arrivals at `rate`/s: the same times for the same `seed`; fresh prompts per `prompt_seed`."""
    arrivals = random.Random(seed)
    gaps = [arrivals.expovariate(rate) for _ in range(n)]
    rng = random.Random(prompt_seed)
    tasks = []
    for gap in gaps:
        await asyncio.sleep(gap)
        tasks.append(asyncio.create_task(one_interactive(client, prompt(rng))))
    results = await asyncio.gather(*tasks)
    return Interactive([t for t, _ in results], sum(k for _, k in results))


async def submit(client: httpx.AsyncClient, n: int, seed: int) -> str:
    rng = random.Random(seed)
    r = await client.post(
        RUN, params={"queueRequest": "true"}, json={"requests": [entry(rng) for _ in range(n)]}
    )
    r.raise_for_status()
    return r.json()["result"]["request_id"]


async def until_done(client: httpx.AsyncClient, request_id: str) -> int:
    """Waits for the batch; its output tokens."""
    while True:
        r = await client.post(RUN, params={"queueRequest": "true"}, json={"request_id": request_id})
        r.raise_for_status()
        result = r.json()["result"]
        if "responses" in result:
            assert all(x["success"] for x in result["responses"]), result["responses"][:2]
            return int(result["usage"]["completion_tokens"])
        await asyncio.sleep(0.2)


async def batch_alone(client: httpx.AsyncClient, n: int, seed: int) -> float:
    t0 = time.perf_counter()
    tokens = await until_done(client, await submit(client, n, seed))
    return tokens / (time.perf_counter() - t0)


async def mixed(
    client: httpx.AsyncClient, n_batch: int, n_inter: int, rate: float, seed: int
) -> tuple[float, Interactive, float]:
    """Batch output tok/s, the interactive load's results, and the interactive output tok/s, over the
    batch's whole run (the interactive arrivals start with it)."""
    t0 = time.perf_counter()
    request_id = await submit(client, n_batch, seed + 1)
    inter_task = asyncio.create_task(interactive_load(client, n_inter, rate, seed, seed + 2))
    tokens = await until_done(client, request_id)
    wall = time.perf_counter() - t0
    inter = await inter_task
    return tokens / wall, inter, inter.output_tokens / wall


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


async def run(url: str, rate: float, n_inter: int, n_batch: int) -> dict[str, float]:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        await one_interactive(client, "warm up")
        idle = await batch_alone(client, n_batch, seed=11)
        alone = await interactive_load(client, n_inter, rate, seed=21, prompt_seed=22)
        batch_rate, busy, inter_rate = await mixed(client, n_batch, n_inter, rate, seed=21)
    print("TTFTs alone:", sorted(round(t, 3) for t in alone.ttfts), file=sys.stderr)
    print("TTFTs with batch:", [round(t, 3) for t in busy.ttfts], file=sys.stderr)
    return {
        "idle_batch": idle,
        "alone_p50": pct(alone.ttfts, 50), "alone_p99": pct(alone.ttfts, 99),
        "busy_p50": pct(busy.ttfts, 50), "busy_p99": pct(busy.ttfts, 99),
        "batch": batch_rate, "interactive_rate": inter_rate,
    }  # fmt: skip


def table(m: dict[str, float], args: argparse.Namespace) -> str:
    flags = " ".join(
        sorted(peers.cpu_flags() & {"avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile"})
    )
    spare = m["idle_batch"] - m["interactive_rate"]
    return "\n".join([
        f"### Batch lane beside interactive work, {peers.cpu_family()} CPU",
        "",
        f"Machine: {peers.cpuinfo_field('model name')}, {os.cpu_count()} CPUs ({flags}); `edgeinfer serve` "
        f"with no flags but `--nats-url` (the default model, default threads); 1-min load average "
        f"{os.getloadavg()[0]:.1f} after. Interactive: {args.interactive} streamed completions arriving at "
        f"{args.rate:g}/s (Poisson), {PROMPT_WORDS}-word prompts, {INTERACTIVE_TOKENS} tokens each. Batch: "
        f"{args.batch} queued entries of {BATCH_TOKENS} tokens (Workers AI's `queueRequest=true`), "
        "submitted as the interactive arrivals start; idle throughput from as many entries alone.",
        "Command: `.venv/bin/python bench/batch_lane.py --write-docs`",
        "",
        "| measure | interactive alone | interactive + batch | ratio | target |",
        "|---|---|---|---|---|",
        f"| interactive TTFT p50 (s) | {m['alone_p50']:.3f} | {m['busy_p50']:.3f} | "
        f"{m['busy_p50'] / m['alone_p50']:.2f}x | <= 1.2x |",
        f"| interactive TTFT p99 (s) | {m['alone_p99']:.3f} | {m['busy_p99']:.3f} | "
        f"{m['busy_p99'] / m['alone_p99']:.2f}x | <= 1.2x |",
        "",
        "| batch output (tok/s) | value |",
        "|---|---|",
        f"| idle node, batch alone | {m['idle_batch']:.1f} |",
        f"| interactive output while both ran | {m['interactive_rate']:.1f} |",
        f"| spare capacity (idle - interactive) | {spare:.1f} |",
        f"| batch while interactive ran | {m['batch']:.1f} "
        f"({m['batch'] / spare:.0%} of spare; target >= 80 %) |",
    ])  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=0.5, help="interactive arrivals per second")
    ap.add_argument("--interactive", type=int, default=30, help="interactive requests per phase")
    ap.add_argument("--batch", type=int, default=192, help="queued entries in the mixed phase")
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        nats = start_nats(NATS_PORT, Path(tmp) / "nats.log")
        try:
            extra = ["--nats-url", f"nats://127.0.0.1:{NATS_PORT}", "--node-id", "bench"]
            with our_server(MODEL, PORT, extra, os.cpu_count() or 1) as server:
                measured = asyncio.run(run(server.base_url, args.rate, args.interactive, args.batch))
        finally:
            nats.terminate()
            nats.wait(10)
    print(measured)
    text = table(measured, args)
    print(text)
    if args.write_docs:
        replace_section(DOCS, f"batch-lane-{peers.cpu_family()}", text)


if __name__ == "__main__":
    main()

"""Embeddings: edgeinfer's packed encoder vs sentence-transformers' `encode`, and serving latency under load.

all-MiniLM-L6-v2 (the default embedding model). Throughput: sentences/s embedding batches of 1, 32 and 512
short texts (8-64 tokens, seed 0), tokenization included on both sides, same process and threads;
sentence-transformers at its best batch size of those tried. Latency: a node server (subprocess) takes a
background load of short single-text requests at a fixed rate (open loop) while probe requests of exactly
32 tokens measure p50/p99, with the micro-batch window on and off.

    .venv/bin/python bench/embeddings.py [--threads 2] [--rate 200 50] [--seconds 10] [--repeats 3] \\
        [--write-docs]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import torch

from edgeinfer.engine.embedding.config import EmbeddingConfig
from edgeinfer.engine.embedding.embedder import Embedder
from edgeinfer.engine.model.loader.default_embedding import resolve_default_embedding_model

sys.path.insert(0, str(Path(__file__).parent))
from docs_table import replace_section
from loadgen import LeanClient

WORDS = [
    "the",
    "model",
    "serves",
    "users",
    "close",
    "to",
    "the",
    "edge",
    "with",
    "low",
    "latency",
    "and",
    "high",
    "throughput",
    "while",
    "semantic",
    "search",
    "ranks",
    "passages",
    "by",
    "cosine",
    "similarity",
    "retrieval",
    "augmented",
    "generation",
    "pastes",
    "documents",
    "into",
    "prompts",
    "every",
    "page",
    "load",
    "embeds",
    "queries",
    "titles",
    "and",
    "snippets",
    "for",
    "recommendations",
    "caching",
    "routing",
    "and",
    "billing",
]
ST_BATCH_SIZES = (16, 32, 64, 128, 256)


def short_texts(embedder: Embedder, n: int, seed: int = 0, lo: int = 8, hi: int = 64) -> list[str]:
    """`n` texts of lo..hi tokens each (with [CLS] and [SEP]), lengths uniform, fixed seed."""
    rng = random.Random(seed)
    return [text_of_tokens(embedder, rng.randint(lo, hi), rng) for _ in range(n)]


def text_of_tokens(embedder: Embedder, tokens: int, rng: random.Random) -> str:
    words: list[str] = []
    while len(embedder.tokenize([" ".join(words)])[0]) < tokens:
        words.append(rng.choice(WORDS))
    while len(embedder.tokenize([" ".join(words)])[0]) > tokens:
        words.pop()
    return " ".join(words)


def rate(fn: Callable[[], object], sentences: int, min_seconds: float = 1.0) -> float:
    """Sentences/s: the median of repeated timed calls after one warm-up, at least `min_seconds` in all."""
    fn()
    times: list[float] = []
    started = time.perf_counter()
    while time.perf_counter() - started < min_seconds or len(times) < 3:
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return sentences / statistics.median(times)


def throughput_rows(
    embedders: dict[str, Embedder], st_models: dict[str, object], sizes: list[int]
) -> list[list]:
    base = next(iter(embedders.values()))
    texts = short_texts(base, max(sizes))
    rows = []
    for n in sizes:
        batch = texts[:n]
        best_st, best_bs, st_name = 0.0, 0, ""
        for name, st in st_models.items():
            for bs in [b for b in ST_BATCH_SIZES if b <= max(n, 16)] if n > 1 else [1]:
                value = rate(lambda st=st, bs=bs, b=batch: st.encode(b, batch_size=bs), n)
                rows.append([n, f"sentence-transformers {name}, batch_size {bs}", value, None])
                print(rows[-1], file=sys.stderr, flush=True)
                if value > best_st:
                    best_st, best_bs, st_name = value, bs, name
        for name, embedder in embedders.items():
            value = rate(lambda e=embedder, b=batch: e.embed(e.tokenize(b)), n)
            rows.append([n, f"edgeinfer {name}", value, value / best_st])
            print(rows[-1], file=sys.stderr, flush=True)
        print(
            f"batch {n}: best sentence-transformers {st_name} bs {best_bs}: {best_st:.0f}/s", file=sys.stderr
        )
    return rows


# ---- latency under load (a server in a subprocess) -------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(window_ms: float, threads: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "edgeinfer.node", "--port", str(port), "--model", "all-minilm-l6-v2"]
    usage_db = Path(tempfile.mkdtemp()) / "usage.sqlite"
    cmd += ["--preload", "--batch-window-ms", str(window_ms), "--no-access-log", "--usage-db", str(usage_db)]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/ready", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("server did not become ready")


async def measure_latency(url: str, background: list[str], probe: str, rps: float, seconds: float) -> dict:
    """Open-loop background requests at `rps`, plus a 32-token probe every 50 ms; probe latencies in ms."""
    # Below the node's default --max-connections-per-client (64): past it the node answers 429, and a
    # request waits here for a connection instead, which the latency then includes. LeanClient, not
    # httpx: the load generator shares the server's cores (loadgen.py).
    client = LeanClient(url, max_connections=60)

    async def one(text: str) -> float | None:
        t = time.perf_counter()
        status, _ = await client.post_json("/v1/embeddings", {"model": "all-minilm-l6-v2", "input": text})
        return (time.perf_counter() - t) * 1000 if status == 200 else None

    try:
        tasks, probes = [], []
        start = time.perf_counter()
        sent = probes_sent = 0
        while (now := time.perf_counter() - start) < seconds:
            while sent < now * rps:
                tasks.append(asyncio.create_task(one(background[sent % len(background)])))
                sent += 1
            if probes_sent < now / 0.05:
                probes.append(asyncio.create_task(one(probe)))
                probes_sent += 1
            await asyncio.sleep(0.001)
        done = await asyncio.gather(*tasks)
        lat = sorted(x for x in await asyncio.gather(*probes) if x is not None)
        elapsed = time.perf_counter() - start
    finally:
        await client.aclose()
    return {
        "achieved_rps": sum(x is not None for x in done) / elapsed,
        "errors": sum(x is None for x in done),
        "p50": lat[len(lat) // 2],
        "p99": lat[min(len(lat) - 1, int(len(lat) * 0.99))],
        "probes": len(lat),
    }


def latency_rows(embedder: Embedder, args: argparse.Namespace) -> list[dict]:
    background = short_texts(embedder, 1000, seed=1)
    probe = text_of_tokens(embedder, 32, random.Random(2))
    rows = []
    for window in (2.0, 0.0):
        proc, url = start_server(window, args.threads)
        try:
            idle = asyncio.run(measure_latency(url, background, probe, 0.0, 3.0))
            for rps in args.rate:
                runs = []
                for _ in range(args.repeats):
                    runs.append(asyncio.run(measure_latency(url, background, probe, rps, args.seconds)))
                    print(f"window {window} ms, {rps} req/s: idle {idle}, loaded {runs[-1]}", file=sys.stderr)
                runs.sort(key=lambda r: r["p50"])
                rows.append({"window": window, "rate": rps, "idle": idle, "runs": runs})
        finally:
            proc.terminate()
            proc.wait(30)
    return rows


# ---- report ----------------------------------------------------------------------------------------
def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def render(args: argparse.Namespace, rows: list[list], latency: list[dict], loads: list[float]) -> str:
    lines = [
        "### Embeddings: all-MiniLM-L6-v2, edgeinfer vs sentence-transformers",
        "",
        f"Machine: {cpu_model()}, {args.threads} threads, torch {torch.__version__}, 1-min load average "
        f"{loads[0]:.1f} at start and {loads[1]:.1f} at the end (the machine is shared with other jobs, so "
        "absolute numbers are noisy; both sides ran in the same process, interleaved). Command: "
        f"`.venv/bin/python bench/embeddings.py --threads {args.threads} --rate "
        f"{' '.join(f'{r:g}' for r in args.rate)} "
        f"--seconds {args.seconds:g} --repeats {args.repeats} --write-docs`. Texts of 8-64 tokens "
        "(uniform, seed 0), tokenization "
        "included; sentence-transformers tried at batch sizes " + ", ".join(map(str, ST_BATCH_SIZES)) + ".",
        "",
        "| texts per call | system | sentences/s | × best sentence-transformers |",
        "|---|---|---|---|",
    ]
    for n, system, value, ratio in rows:
        lines.append(f"| {n} | {system} | {value:.0f} | {'' if ratio is None else f'{ratio:.2f}'} |")
    lines += [
        "",
        "Serving latency of one 32-token request (probes every 50 ms) under a background load of "
        f"single-text requests (open loop, 8-64 tokens) at each rate, {args.repeats} runs of "
        f"{args.seconds:g} s each; the loaded columns are the run with the median p50 (the machine's "
        "neighbours move single runs several-fold), errors summed over runs; the load "
        "generator (bench/loadgen.py, ~0.1 ms of CPU a request) runs on the same machine, on at most 60 "
        "connections (the node's per-client limit is 64). Server: `edgeinfer serve --model "
        "all-minilm-l6-v2` (bf16).",
        "",
        "| batch window | offered req/s | idle p50 ms | idle p99 ms | loaded p50 ms | loaded p99 ms "
        "| loaded p50, all runs | achieved req/s | errors |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in latency:
        idle, runs = row["idle"], row["runs"]
        median = runs[len(runs) // 2]
        spread = ", ".join(f"{r['p50']:.0f}" for r in runs)
        lines.append(
            f"| {row['window']:g} ms | {row['rate']:g} | {idle['p50']:.1f} | {idle['p99']:.1f} | "
            f"{median['p50']:.1f} | {median['p99']:.1f} | {spread} | {median['achieved_rps']:.0f} | "
            f"{sum(r['errors'] for r in runs)} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 32, 512])
    parser.add_argument(
        "--rate", type=float, nargs="+", default=[200.0, 50.0], help="background requests/s, each in turn"
    )
    parser.add_argument("--seconds", type=float, default=10.0, help="length of each loaded run")
    parser.add_argument("--repeats", type=int, default=3, help="loaded runs per rate and window")
    parser.add_argument("--skip-latency", action="store_true")
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from sentence_transformers import SentenceTransformer

    loads = [os.getloadavg()[0]]
    path = str(resolve_default_embedding_model())
    # The default (auto attention, passes capped at 2048 tokens); the same with grouped SDPA, to show the
    # packed kernel's share; fp32; and one pass for the whole batch, to show why passes are capped.
    variants = [("bfloat16", "auto", 2048), ("bfloat16", "grouped", 2048), ("float32", "auto", 2048)]
    variants.append(("bfloat16", "auto", 1 << 20))
    built = [
        Embedder(EmbeddingConfig(path, dtype=dtype, attention=attention, max_pass_tokens=cap))
        for dtype, attention, cap in variants
    ]
    embedders = {
        f"{e.config.dtype}, {e.attention} attention, passes of ≤ {e.config.max_pass_tokens} tokens": e
        for e in built
    }
    st_models = {
        "float32": SentenceTransformer(path, device="cpu"),
        "bfloat16": SentenceTransformer(path, device="cpu", model_kwargs={"dtype": torch.bfloat16}),
    }
    rows = throughput_rows(embedders, st_models, args.sizes)
    latency = [] if args.skip_latency else latency_rows(next(iter(embedders.values())), args)
    loads.append(os.getloadavg()[0])
    report = render(args, rows, latency, loads)
    print(report)
    if args.write_docs:
        replace_section(Path(__file__).parent.parent / "docs" / "benchmarks.md", "embeddings", report)


if __name__ == "__main__":
    main()

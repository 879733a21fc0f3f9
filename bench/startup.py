"""Cold start: time from process start to ready, and to the first answered request, for `edgeinfer serve`
and llama.cpp's llama-server on the same model, one after the other, in one run.

    python bench/startup.py                          # bf16, int8, int4, int4 --compile; writes the table
    python bench/startup.py --configs bf16 --no-docs

Each configuration is measured in one sitting: llama-server's first start (its GGUF in the page cache), ours
with an empty cache directory (`--cache-dir`: the first start prepares the model, dequantizing the GGUF,
quantizing, compiling, and fills the cache), then `--repeats` cached starts of each, taking turns; the table
gives the medians. "Ready" is `/ready` (ours, with `--preload gemma-3-270m`: the model llama-server loads,
not the MiniLM embedding model a bare `--preload` adds, ~0.3-0.4 s more) or `/health` (llama-server)
answering 200; "answered" is when a `/v1/completions` request of 8 greedy tokens has come back. The default
model's GGUF and its tokenizer are already assembled in the model cache before the first start (one-time
install steps that llama-server has no counterpart of). llama-server starts on the GGUF of its own precision
class (bench/peers.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "src"), str(REPO / "bench")]  # run as a script without installing the package

import peers  # noqa: E402
import serve_report  # noqa: E402
from docs_table import replace_section  # noqa: E402

from edgeinfer.bench.process import start_server  # noqa: E402
from edgeinfer.engine.model.loader.default_model import DEFAULT_MODEL, resolve_default_model  # noqa: E402

DOCS = REPO / "docs" / "benchmarks.md"
RESULTS = REPO / "bench" / "results"
CACHES = RESULTS / "startup-cache"
CPU = peers.cpu_family()  # one table per kind of CPU
STORE = RESULTS / f"startup-{CPU}.json"
SECTION = f"startup-bench-{CPU}"
CONFIGS = {
    "bf16": [],
    "int8": ["--quantization", "int8"],
    "int4": ["--quantization", "int4"],
    "int4 --compile": ["--quantization", "int4", "--compile"],
    "bf16 --compile": ["--compile"],
}
PEER_PRECISION = {"bf16": "bf16", "int8": "int8", "int4": "int4"}
PROMPT = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0.0}


@dataclass
class Start:
    ready_s: float
    answered_s: float


def timed_start(
    argv: list[str], url: str, health: str, env: dict[str, str], log: Path, timeout_s: float
) -> Start:
    """Start `argv`, poll `health` every 20 ms until 200, send one completion, stop; times from the spawn."""
    t0 = time.perf_counter()
    server = start_server(argv, url, log, health, timeout_s, env, poll_s=0.02)
    try:
        ready = time.perf_counter() - t0
        with httpx.Client(timeout=timeout_s) as client:
            reply = client.post(url + "/v1/completions", json={"model": "gemma-3-270m", **PROMPT})
            reply.raise_for_status()
            return Start(ready, time.perf_counter() - t0)
    finally:
        server.stop()


def our_starts(config: str, port: int, threads: int, timeout_s: float) -> Iterator[Start]:
    """Starts of `edgeinfer serve` in `config`, as many as are taken: the first with an empty cache."""
    cache = CACHES / config.replace(" ", "").replace("-", "_")
    shutil.rmtree(cache, ignore_errors=True)
    argv = [sys.executable, "-m", "edgeinfer.cli", "serve", "--preload", DEFAULT_MODEL, "--host", "127.0.0.1",
            "--port", str(port), "--no-access-log", "--usage-db", str(RESULTS / "usage.sqlite"),
            "--cache-dir", str(cache), *CONFIGS[config]]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
           "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    log = RESULTS / "logs" / f"startup-{cache.name}.log"
    print(f"{config}: {shlex.join(argv)}", file=sys.stderr)
    while True:
        yield timed_start(argv, url, "/ready", env, log, timeout_s)


def llama_starts(precision: str, gguf: Path, port: int, threads: int) -> Iterator[Start]:
    peer = peers.peer_gguf(precision, gguf)
    argv = peers.llama_server_argv(peer, port, n_parallel=1, ctx=2048, threads=threads)
    log = peers.PEERS_DIR / "logs" / f"llama-server-startup-{precision}.log"
    print(f"llama-server {precision}: {shlex.join(argv)}", file=sys.stderr)
    while True:
        yield timed_start(argv, f"http://127.0.0.1:{port}", "/health", dict(os.environ), log, 120)


def median_start(starts: list[Start]) -> list[float]:
    return [statistics.median(s.ready_s for s in starts), statistics.median(s.answered_s for s in starts)]


def measure(config: str, gguf: Path, args: argparse.Namespace) -> Row:
    """Each server's first start (llama-server's file already in the page cache), then `repeats` cached
    starts of each, taking turns so that a busy spell of the shared machine falls on both; medians."""
    load_before = os.getloadavg()[0]
    theirs = llama_starts(PEER_PRECISION[config.split()[0]], gguf, args.port, args.threads)
    mine = our_starts(config, args.port + 1, args.threads, args.timeout)
    firsts = [next(theirs), next(mine)]
    pairs = [(next(theirs), next(mine)) for _ in range(args.repeats)]
    return {
        "config": config,
        "ours": [[firsts[1].ready_s, firsts[1].answered_s], median_start([p[1] for p in pairs])],
        "peer": [[firsts[0].ready_s, firsts[0].answered_s], median_start([p[0] for p in pairs])],
        "repeats": args.repeats,
        "load": [load_before, os.getloadavg()[0]],
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def cpu_flags() -> str:
    wanted = ("avx2", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16")
    try:
        with open("/proc/cpuinfo") as f:
            flags = next(line for line in f if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return "unknown"
    return " ".join(w for w in wanted if w in flags) or "none of the AVX2/AVX-512/AMX flags"


Row = dict  # {"config", "ours"/"peer": [first, cached median], each [ready, answered], "load", "date"}


def table(rows: list[Row]) -> str:
    lines = [
        "| configuration | first start: ready / answered (s) | cached start: ready / answered (s) "
        "| llama-server, same class, cached: ready / answered (s) | cached start ready ÷ llama-server's "
        "| load avg before → after | measured |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        (first, second), peer = row["ours"], row["peer"][1]
        lines.append(
            f"| `{' '.join(['serve', *CONFIGS[row['config']]])}` | {first[0]:.1f} / {first[1]:.1f} "
            f"| {second[0]:.2f} / {second[1]:.2f} | {peer[0]:.2f} / {peer[1]:.2f} "
            f"| {second[0] / peer[0]:.1f}× | {row['load'][0]:.1f} → {row['load'][1]:.1f} | {row['date']} |"
        )
    return "\n".join(lines)


def describe(args: argparse.Namespace, rows: list[Row]) -> str:
    machine = (
        f"Machine: {serve_report.machine_info()}; CPU flags: {cpu_flags()}; {args.threads} threads. "
        "The machine is shared with other work (1-min load averages per row), so absolute times are noisy: "
        "the cached starts of the two servers take turns, one server at a time, and each cell is the median "
        f"of {args.repeats}."
    )
    setup = (
        "Command: `python bench/startup.py [--configs ...]` (rows kept in bench/results/startup-CPU.json, "
        "each rerun replaces its own). Gemma 3 270M; ours from its "
        "Q4_K_M GGUF (`edgeinfer serve --preload gemma-3-270m`, the one model llama-server loads; "
        "`--cache-dir` emptied before the first start); "
        f"llama-server (llama-cpp-python {peers.LLAMA_CPP_PYTHON_VERSION}) on the GGUF of the same class "
        "(BF16, Q8_0, Q4_K_M). Ready: `/ready` or `/health` answers 200; answered: an 8-token greedy "
        "completion has come back."
    )
    title = f"### Cold start: process start to ready, edgeinfer vs llama-server, {CPU} CPU"
    return "\n".join([title, "", machine, setup, "", table(rows)])


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--configs", nargs="+", default=["bf16", "int8", "int4", "int4 --compile"], choices=list(CONFIGS)
    )
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--repeats", type=int, default=5, help="cached starts of each server, taking turns")
    p.add_argument("--port", type=int, default=18431)
    p.add_argument("--timeout", type=float, default=1800.0, help="per start, seconds")
    p.add_argument("--no-docs", action="store_true")
    p.add_argument("--render-only", action="store_true", help="rewrite the table from the stored rows")
    return p.parse_args()


def main() -> int:
    args = parse_args()
    gguf = resolve_default_model()
    stored = json.loads(STORE.read_text()) if STORE.exists() else {}
    if args.render_only:
        replace_section(DOCS, SECTION, describe(args, [stored[c] for c in CONFIGS if c in stored]))
        return 0
    for config in args.configs:
        stored[config] = measure(config, gguf, args)
        STORE.parent.mkdir(parents=True, exist_ok=True)
        STORE.write_text(json.dumps(stored, indent=1))
        body = describe(args, [stored[c] for c in CONFIGS if c in stored])
        print(body)
        if not args.no_docs:  # after every configuration: a long run that is stopped keeps what it measured
            replace_section(DOCS, SECTION, body)
            print(f"updated {DOCS.relative_to(REPO)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

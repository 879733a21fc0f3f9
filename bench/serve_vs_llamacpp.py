"""Serve Gemma 3 270M with llama.cpp's llama-server and with edgeinfer, drive both with identical workloads.

    python bench/serve_vs_llamacpp.py --precision int4                  # concurrency 1, 8, 32, 64
    python bench/serve_vs_llamacpp.py --batch-window-sweep --rates 2 4 8
    python bench/serve_vs_llamacpp.py --precision bf16 --paired-rounds 5  # one stream, servers alternating

The servers run one after the other on 127.0.0.1 (never both at once: they would share the cores), with the
same thread count. Each concurrency level sends `max(min_prompts, prompts_per_slot * C)` random prompts of
fixed input and output length (ignore_eos), capped at C in flight; its prompts are seeded by C, so no level
hits the prefix cache of another, and both servers see exactly the same prompts. llama-server runs with -np 64
slots and continuous batching. Results: JSON under bench/results/, a table and plots in docs/benchmarks.md
(sections serve-bench-PRECISION-CPU, one per precision and kind of CPU: intel, amd, aarch64).

`--paired-rounds N` measures one stream only, with both servers up (the idle one sleeps) and the two taking
turns N times, each turn on fresh prompts: the memory bandwidth a shared machine leaves a single stream
drifts by tens of percent within minutes, so the ratio of each pair is the number to read, not two runs
minutes apart (section serve-single-PRECISION-CPU).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import shlex
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "src"), str(REPO / "bench")]  # run as a script without installing the package

import peers  # noqa: E402
import roofline  # noqa: E402
import serve_report  # noqa: E402
from docs_table import replace_section  # noqa: E402

from edgeinfer.bench.cli import discover_model  # noqa: E402
from edgeinfer.bench.datasets import random_dataset  # noqa: E402
from edgeinfer.bench.metrics import Summary  # noqa: E402
from edgeinfer.bench.process import ServerProcess, running_server  # noqa: E402
from edgeinfer.bench.report import write_json  # noqa: E402
from edgeinfer.bench.runner import BenchConfig, run_benchmark  # noqa: E402
from edgeinfer.engine.model.loader.default_model import resolve_default_model  # noqa: E402
from edgeinfer.engine.threads import available_cores  # noqa: E402

DOCS = REPO / "docs" / "benchmarks.md"
RESULTS = REPO / "bench" / "results"
# Our engine's flags for each precision class (`--ours-args` replaces them): the defaults a user gets, so
# our CPU kernels where the CPU has the features (bf16 decode; int8 and int4 through VNNI, int4 as W4A8,
# as llama.cpp multiplies its Q4/Q5 weights by Q8 activations) and no compiled graph.
OUR_PRECISION_ARGS = {"bf16": [], "int8": ["--quantization", "int8"],
                      "int4": ["--quantization", "int4"]}  # fmt: skip


@dataclass(frozen=True)
class Workload:
    input_len: int = 128
    output_len: int = 128
    prompts_per_slot: int = 2
    min_prompts: int = 8
    seed: int = 0

    def num_prompts(self, concurrency: int) -> int:
        return max(self.min_prompts, self.prompts_per_slot * concurrency)


def bench_level(
    server: ServerProcess, work: Workload, n: int, seed: int, concurrency: int | None, rate: float = math.inf
) -> Summary:
    """`n` prompts (from `seed`) against a running server, `concurrency` in flight (None: no cap),
    `rate`/s."""
    sessions = random_dataset(n, (work.input_len,) * 2, (work.output_len,) * 2, seed)
    model = discover_model(server.base_url, None)
    config = BenchConfig(server.base_url, model, request_rate=rate, max_concurrency=concurrency,
                         num_warmups=3, seed=seed)  # fmt: skip
    summary = asyncio.run(run_benchmark(config, sessions)).summary
    cap = concurrency or "uncapped"
    print(f"  C={cap} rate={rate:g}: {summary.output_throughput:8.1f} out tok/s, TTFT p50 "
          f"{summary.ttft_ms.median:8.1f} ms, TPOT p50 {summary.tpot_ms.median:6.1f} ms, "
          f"{summary.completed}/{summary.failed} ok/failed", file=sys.stderr)  # fmt: skip
    for error in summary.errors[:3]:
        print(f"    error: {error}", file=sys.stderr)
    return summary


@contextlib.contextmanager
def our_server(model: str, port: int, extra: list[str], threads: int) -> Iterator[ServerProcess]:
    """edgeinfer's node server on 127.0.0.1:`port`, model preloaded (/ready waits for it), stopped on exit."""
    argv = [sys.executable, "-m", "edgeinfer.cli", "serve", "--model", model, "--preload",
            "--host", "127.0.0.1", "--port", str(port), "--no-access-log",
            "--usage-db", str(RESULTS / "usage.sqlite"), "--threads", str(threads), *extra]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    log = RESULTS / "logs" / f"edgeinfer-{port}.log"
    print(f"starting: {shlex.join(argv)}", file=sys.stderr)
    with running_server(argv, f"http://127.0.0.1:{port}", log, "/ready", timeout_s=900, env=env) as server:
        _refuse_fallback(log)
        yield server


# What the loader logs when our CPU kernels did not build (engine/loading.py): the server then serves on
# torch's kernels, which is not what the tables are about (an edit to a kernel source while a run started
# a server once measured int4 at a third of its speed).
FALLBACK = ("keep torch's kernels", "loading afresh with torch's kernels")


def _refuse_fallback(log: Path) -> None:
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if any(f in ln for f in FALLBACK)]
    if lines:
        raise SystemExit(f"our server fell back to torch's kernels, not measuring it: {lines[0].strip()}")


def llama_version() -> str:
    out = subprocess.run([str(peers.binary("llama-server")), "--version"], capture_output=True, text=True)
    lines = [line for line in (out.stdout + out.stderr).splitlines() if line.startswith("version")]
    return lines[0] if lines else "unknown version"


def _level(server: ServerProcess, work: Workload, concurrency: int) -> Summary:
    # Seeded by the level, so a level never finds another level's prompts in the server's prefix cache.
    return bench_level(server, work, work.num_prompts(concurrency), work.seed + concurrency, concurrency)


def _threads(n: int) -> str:
    return f"{n} thread" if n == 1 else f"{n} threads"


def _our_args(args: argparse.Namespace) -> list[str]:
    return shlex.split(args.ours_args) if args.ours_args is not None else OUR_PRECISION_ARGS[args.precision]


def compare(args: argparse.Namespace, gguf: Path) -> None:
    work = Workload(args.input_len, args.output_len, args.prompts_per_slot, args.min_prompts, args.seed)
    load_before = os.getloadavg()[0]
    results: serve_report.Results = {}
    if not args.skip_llama:
        peer = peers.peer_gguf(args.precision, gguf)
        print(f"llama-server on {peer.name}", file=sys.stderr)
        with peers.llama_server(peer, args.port, n_parallel=max(args.concurrency), ctx=args.ctx,
                                threads=args.threads) as server:  # fmt: skip
            results["llama.cpp"] = {c: _level(server, work, c) for c in args.concurrency}
    if not args.skip_ours:
        with our_server(args.model, args.port + 1, _our_args(args), args.threads) as server:
            results["edgeinfer"] = {c: _level(server, work, c) for c in args.concurrency}
    kind = f"{args.precision}-{peers.cpu_family()}"
    tag = f"serve_vs_llamacpp-{kind}"
    doc = {label: {c: s.to_dict() for c, s in levels.items()} for label, levels in results.items()}
    write_json(RESULTS / f"{tag}.json", doc)
    broken = [label for label, levels in results.items() if not any(s.completed for s in levels.values())]
    if broken:  # a server that answered nothing is a setup problem, not a result worth publishing
        print(f"no request succeeded on {', '.join(broken)}: docs left unchanged", file=sys.stderr)
    elif args.write_docs:  # the table and its plot
        plot = REPO / "docs" / "img" / f"serve-bench-{kind}.png"
        title = f"Gemma 3 270M, {args.precision} class, {_threads(args.threads)}"
        serve_report.plot_comparison(results, plot, title)
        load = (load_before, os.getloadavg()[0])
        doc = _comparison_doc(args, results, plot, gguf, load)
        replace_section(DOCS, f"serve-bench-{kind}", doc)
        print(f"updated {DOCS.relative_to(REPO)}", file=sys.stderr)


def paired_single_stream(args: argparse.Namespace, gguf: Path) -> None:
    """One stream on each server in turn, `args.paired_rounds` times, both servers up throughout."""
    work = Workload(args.input_len, args.output_len, min_prompts=args.min_prompts, seed=args.seed)
    load_before = os.getloadavg()[0]
    peer = peers.peer_gguf(args.precision, gguf)
    rounds: list[dict[str, Summary]] = []
    with (
        peers.llama_server(peer, args.port, n_parallel=1, ctx=args.ctx, threads=args.threads) as llama,
        our_server(args.model, args.port + 1, _our_args(args), args.threads) as ours,
    ):
        for r in range(args.paired_rounds):
            seed = work.seed + 1000 * (r + 1)  # fresh prompts each turn: no prefix-cache hits
            rounds.append({label: bench_level(server, work, work.min_prompts, seed, 1)
                           for label, server in (("llama.cpp", llama), ("edgeinfer", ours))})  # fmt: skip
    kind = f"{args.precision}-{peers.cpu_family()}"
    doc = [{label: s.to_dict() for label, s in pair.items()} for pair in rounds]
    write_json(RESULTS / f"serve_single-{kind}.json", doc)
    if args.write_docs:
        load = (load_before, os.getloadavg()[0])
        replace_section(DOCS, f"serve-single-{kind}", _paired_doc(args, rounds, peer.name, load))
        print(f"updated {DOCS.relative_to(REPO)}", file=sys.stderr)


def _paired_doc(
    args: argparse.Namespace, rounds: list[dict[str, Summary]], peer_file: str, load: tuple[float, float]
) -> str:
    rows = ["| turn | llama.cpp decode tok/s | edgeinfer decode tok/s | ratio | llama.cpp TTFT p50 ms | "
            "edgeinfer TTFT p50 ms |", "|---|---|---|---|---|---|"]  # fmt: skip
    ratios = []
    for i, pair in enumerate(rounds, 1):
        peer, ours = pair["llama.cpp"], pair["edgeinfer"]
        a, b = serve_report.decode_tok_s(ours), serve_report.decode_tok_s(peer)
        ratios.append(a / b)
        rows.append(f"| {i} | {b:.1f} | {a:.1f} | {a / b:.2f}× | {peer.ttft_ms.median:.1f} | "
                    f"{ours.ttft_ms.median:.1f} |")  # fmt: skip
    ratios.sort()
    return "\n".join([
        f"### One stream, servers taking turns: edgeinfer vs llama.cpp, {args.precision} class, "
        f"{peers.cpu_family()} CPU",
        "",
        f"Machine: {serve_report.machine_info()}; both servers up, {_threads(args.threads)} each, one "
        f"measured at a time; 1-min load average {load[0]:.1f} before, {load[1]:.1f} after.",
        f"llama.cpp: llama-server {llama_version()}, `{peer_file}`, `-np 1` (one slot); edgeinfer: "
        f"`edgeinfer serve {shlex.join(_our_args(args))}`.",
        f"Workload per turn: {args.min_prompts} requests one at a time, random prompts of {args.input_len} "
        f"tokens, {args.output_len} output tokens (ignore_eos), fresh prompts every turn.",
        f"Command: `python bench/serve_vs_llamacpp.py {shlex.join(sys.argv[1:])}`",
        "",
        *rows,
        "",
        f"Median ratio of the turns: {ratios[len(ratios) // 2]:.2f}× "
        f"(range {ratios[0]:.2f}–{ratios[-1]:.2f}×).",
    ])  # fmt: skip


def _comparison_doc(
    args: argparse.Namespace, results: serve_report.Results, plot: Path, gguf: Path, load: tuple[float, float]
) -> str:
    context = args.input_len + args.output_len // 2  # mean context while decoding
    roof = roofline.roofline(context, batches=[1, 8, 32, 64], threads=args.threads)
    peer_file = peers.peer_gguf(args.precision, gguf).name if "llama.cpp" in results else "not run"
    lines = [
        f"### Serving: edgeinfer vs llama.cpp, {args.precision} class, {peers.cpu_family()} CPU",
        "",
        f"Machine: {serve_report.machine_info()}; both servers use {_threads(args.threads)}, one at a time; "
        f"1-min load average {load[0]:.1f} before, {load[1]:.1f} after (other work here skews results).",
        f"llama.cpp: llama-server {llama_version()} "
        f"(from llama-cpp-python {peers.LLAMA_CPP_PYTHON_VERSION}), `{peer_file}`, "
        f"`-np {max(args.concurrency)}` with continuous batching.",
        f"edgeinfer: `edgeinfer serve {shlex.join(_our_args(args))}`.",
        f"Workload: random prompts of {args.input_len} tokens, {args.output_len} output tokens (ignore_eos), "
        f"max({args.min_prompts}, {args.prompts_per_slot}×C) requests per concurrency level C, "
        "all sent at once with C in flight.",
        f"Command: `python bench/serve_vs_llamacpp.py {shlex.join(sys.argv[1:])}`",
        "",
        serve_report.comparison_table(results),
        "",
    ]
    if "edgeinfer" in results and "llama.cpp" in results:
        lines += [serve_report.targets_table(results["edgeinfer"], results["llama.cpp"]), ""]
    lines += [roofline.summary_line(roof), "", f"![serving comparison](img/{plot.name})"]
    return "\n".join(lines)


def window_sweep(args: argparse.Namespace) -> None:
    """Our server at each batch_window_ms, Poisson arrivals at each rate, no concurrency cap."""
    work = Workload(args.input_len, args.output_len, min_prompts=args.sweep_prompts, seed=args.seed)
    sweep: dict[float, dict[float, Summary]] = {}
    load_before = os.getloadavg()[0]
    for window in args.windows:
        extra = [*_our_args(args), args.batch_window_flag, f"{window:g}"]
        with our_server(args.model, args.port + 1, extra, args.threads) as server:
            # Same prompts for every window (seed by rate index): the windows differ in nothing else.
            sweep[window] = {
                rate: bench_level(server, work, work.min_prompts, args.seed + 100 * i, None, rate)
                for i, rate in enumerate(args.rates)
            }
    write_json(RESULTS / "batch_window_sweep.json",
               {w: {r: s.to_dict() for r, s in by.items()} for w, by in sweep.items()})  # fmt: skip
    plot = REPO / "docs" / "img" / "batch-window-sweep.png"
    serve_report.plot_sweep(sweep, plot)
    if args.write_docs:
        body = "\n".join([
            "### Micro-batch window sweep (edgeinfer)", "",
            f"Machine: {serve_report.machine_info()}; {_threads(args.threads)}; 1-min load average "
            f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after. Poisson arrivals, {work.min_prompts} "
            f"requests per point, {args.input_len} input / {args.output_len} output tokens, uncapped.",
            f"Command: `python bench/serve_vs_llamacpp.py {shlex.join(sys.argv[1:])}`",
            "One run per point: on a shared machine repeated runs differ by tens of percent, so only large "
            "gaps mean anything.", "",
            serve_report.sweep_table(sweep), "", f"![batch window sweep](img/{plot.name})",
        ])  # fmt: skip
        replace_section(DOCS, "batch-window-sweep", body)


def parse_args() -> argparse.Namespace:
    formatter = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    p.add_argument("--precision", choices=sorted(peers.PEER_WEIGHT_TYPES), default="int4")
    p.add_argument("--gguf", type=Path, default=None, help="Q4_K_M source (default: the default model)")
    p.add_argument("--model", default="gemma-3-270m", help="model name or path our server loads")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--prompts-per-slot", type=int, default=2)
    p.add_argument("--min-prompts", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=available_cores(), help="default: every core available")
    p.add_argument("--ctx", type=int, default=512, help="llama-server KV tokens per slot")
    p.add_argument("--port", type=int, default=8310, help="llama-server port; ours uses port + 1")
    p.add_argument("--ours-args", default=None, help="extra flags for `edgeinfer serve` (quoted)")
    p.add_argument("--skip-llama", action="store_true")
    p.add_argument("--skip-ours", action="store_true")
    p.add_argument(
        "--no-docs", dest="write_docs", action="store_false", help="leave docs/benchmarks.md alone"
    )
    p.add_argument("--paired-rounds", type=int, default=0, help="one stream, servers taking turns N times")
    p.add_argument("--batch-window-sweep", action="store_true")
    p.add_argument("--windows", type=float, nargs="+", default=[0, 2, 5, 10])
    p.add_argument("--rates", type=float, nargs="+", default=[2, 4, 8])
    p.add_argument("--sweep-prompts", type=int, default=32, help="requests per (window, rate) point")
    p.add_argument("--batch-window-flag", default="--batch-window-ms")
    return p.parse_args()


def main() -> int:
    args = parse_args()
    # SIGTERM must unwind the server context managers too, or the servers would outlive this script.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.batch_window_sweep:
        window_sweep(args)
        return 0
    if not args.skip_llama:
        peers.build()
    gguf = args.gguf or resolve_default_model()
    if args.paired_rounds:
        paired_single_stream(args, gguf)
    else:
        compare(args, gguf)
    return 0


if __name__ == "__main__":
    sys.exit(main())

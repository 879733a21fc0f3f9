"""What the server adds to one stream's tokens: the engine stepping in-process against `edgeinfer serve`.

    python bench/serve_overhead.py --threads 1 2 --rounds 3 --write-docs

For each thread count, each round measures one greedy request of the default model (a 128-token prompt of
random ids, `--output-len` tokens, ignore_eos) twice, one after the other: stepped by `LLMEngine` in a fresh
process (the in-process step time), and streamed from a running `edgeinfer serve` over /v1/completions
(client-side TTFT and time per output token). Wall times on a shared machine are noisy, so each server run
also records the CPU time every thread of the server spent per output token (from /proc) and its context
switches: the event loop's CPU per token is the server's own work, whatever the load. Writes the
`serve-overhead` block of docs/benchmarks.md with `--write-docs`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "src"), str(REPO / "bench")]

from docs_table import replace_section  # noqa: E402

from edgeinfer.bench.process import running_server  # noqa: E402
from edgeinfer.engine.async_engine import STEP_THREAD_NAME  # noqa: E402

DOCS = REPO / "docs" / "benchmarks.md"
LOGS = REPO / "bench" / "results" / "logs"
TICK_MS = 1000 / os.sysconf("SC_CLK_TCK")


def prompt_ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 200_000) for _ in range(n)]


def in_process(threads: int, seed: int, input_len: int, output_len: int) -> dict[str, float]:
    """Runs in the child: load the engine, step one request, report prefill and decode step times."""
    from edgeinfer.engine.config import EngineConfig
    from edgeinfer.engine.engine import LLMEngine
    from edgeinfer.engine.runtime import start_runtime
    from edgeinfer.types import EngineRequest, SamplingParams

    start_runtime(threads)
    engine = LLMEngine(EngineConfig(batch_window_ms=0))
    sampling = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    engine.generate([prompt_ids(seed + 1000, input_len)], sampling)  # warm-up: first-use costs
    engine.add_request(EngineRequest("r", prompt_ids(seed, input_len), sampling, arrival_time=engine.clock()))
    steps, cpu0 = [], time.process_time()
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - start)
    cpu_ms = (time.process_time() - cpu0) * 1000 / output_len
    return {"first_ms": steps[0] * 1000, "token_ms": statistics.median(steps[1:]) * 1000, "cpu_ms": cpu_ms}


def _threads_cpu(pid: int) -> dict[str, tuple[float, int, int]]:
    """Per thread (name#tid): CPU ms, voluntary and involuntary context switches."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text().rsplit(")", 1)[1].split()
            status = dict(
                line.split(":\t") for line in (task / "status").read_text().splitlines() if ":\t" in line
            )
            name = (task / "comm").read_text().strip()
        except (FileNotFoundError, ProcessLookupError):
            continue
        cpu = (int(stat[11]) + int(stat[12])) * TICK_MS
        out[f"{name}#{task.name}"] = (cpu, int(status["voluntary_ctxt_switches"]),
                                      int(status["nonvoluntary_ctxt_switches"]))  # fmt: skip
    return out


def _role(key: str, pid: int) -> str:
    """What a server thread is: the main thread runs the event loop; the step thread names itself, and the
    OpenMP workers it starts inherit its name."""
    name, tid = key.split("#")
    if int(tid) == pid:
        return "event loop"
    return "step thread + OpenMP workers" if name == STEP_THREAD_NAME else "other threads"


def stream_once(url: str, seed: int, input_len: int, output_len: int) -> tuple[float, float]:
    body = {"model": "gemma-3-270m", "prompt": prompt_ids(seed, input_len), "max_tokens": output_len,
            "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
    stamps, start = [], time.perf_counter()
    with httpx.Client(timeout=600) as client, client.stream("POST", url + "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                stamps.append(time.perf_counter())
    return (stamps[0] - start) * 1000, (stamps[-1] - stamps[0]) * 1000 / (len(stamps) - 1)


def served(url: str, pid: int, seed: int, input_len: int, output_len: int) -> dict[str, object]:
    before = _threads_cpu(pid)
    ttft, tpot = stream_once(url, seed, input_len, output_len)
    after = _threads_cpu(pid)
    per_thread: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
    for key, (cpu, vol, invol) in after.items():
        b = before.get(key, (0.0, 0, 0))
        name = _role(key, pid)
        for i, (x, y) in enumerate(((cpu, b[0]), (vol, b[1]), (invol, b[2]))):
            per_thread[name][i] += (x - y) / output_len
    busy = {name: v for name, v in per_thread.items() if v[0] > 0.05}
    return {"first_ms": ttft, "token_ms": tpot, "threads": busy}


def measure(args: argparse.Namespace) -> dict[int, dict[str, list[dict]]]:
    results: dict[int, dict[str, list[dict]]] = {t: {"in-process": [], "server": []} for t in args.threads}
    LOGS.mkdir(parents=True, exist_ok=True)
    for threads in args.threads:
        argv = [sys.executable, "-m", "edgeinfer.cli", "serve", "--preload", "gemma-3-270m",
                "--host", "127.0.0.1",
                "--port", str(args.port), "--no-access-log", "--threads", str(threads),
                "--usage-db", str(LOGS.parent / "usage.sqlite")]  # fmt: skip
        url = f"http://127.0.0.1:{args.port}"
        with running_server(argv, url, LOGS / "serve-overhead.log", "/ready", timeout_s=900) as server:
            stream_once(url, 10_000, args.input_len, 8)  # warm-up
            for rnd in range(args.rounds):
                seed = 100 * rnd + threads
                child = [sys.executable, __file__, "--worker", str(threads), str(seed),
                         str(args.input_len), str(args.output_len)]  # fmt: skip
                line = subprocess.run(child, capture_output=True, text=True, check=True).stdout.splitlines()[
                    -1
                ]
                results[threads]["in-process"].append({**json.loads(line), "load": os.getloadavg()[0]})
                row = served(url, server.process.pid, seed, args.input_len, args.output_len)
                results[threads]["server"].append({**row, "load": os.getloadavg()[0]})
                print(threads, rnd, results[threads]["in-process"][-1], row, file=sys.stderr)
    return results


def _fmt_threads(rows: list[dict]) -> str:
    names = sorted(
        {n for r in rows for n in r["threads"]}, key=lambda n: -sum(r["threads"].get(n, [0])[0] for r in rows)
    )
    parts = []
    for name in names:
        vals = [r["threads"][name] for r in rows if name in r["threads"]]
        cpu, vol, invol = (statistics.median(v[i] for v in vals) for i in range(3))
        parts.append(f"{name} {cpu:.1f} ms ({vol:.0f} / {invol:.0f} cs)")
    return "; ".join(parts)


def report(args: argparse.Namespace, results: dict[int, dict[str, list[dict]]], load0: float) -> str:
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())  # fmt: skip
    lines = [
        "### Serving overhead: one stream in-process vs through `edgeinfer serve`",
        "",
        f"Machine: {cpu}, {os.cpu_count()} CPUs; Python {platform.python_version()}; 1-min load average "
        f"{load0:.1f} before, {os.getloadavg()[0]:.1f} after (the machine is shared: read the CPU columns, "
        "and the minimum of the wall times).",
        f"Command: `python bench/serve_overhead.py --threads {' '.join(map(str, args.threads))} --rounds "
        f"{args.rounds} --output-len {args.output_len} --write-docs`",
        f"Workload: default model (Gemma 3 270M bf16), one greedy request, {args.input_len}-token prompt, "
        f"{args.output_len} output tokens; {args.rounds} rounds, in-process and server alternating.",
        "",
        "| threads | path | first token ms (min / median) | per token ms (min / median) | load per round |",
        "|---|---|---|---|---|",
    ]
    for threads, paths in results.items():
        for path, rows in paths.items():
            first = [r["first_ms"] for r in rows]
            tok = [r["token_ms"] for r in rows]
            loads = ", ".join(f"{r['load']:.1f}" for r in rows)
            lines.append(f"| {threads} | {path} | {min(first):.1f} / {statistics.median(first):.1f} | "
                         f"{min(tok):.1f} / {statistics.median(tok):.1f} | {loads} |")  # fmt: skip
    lines += ["", "Server CPU per output token by thread, median of rounds (voluntary / involuntary context "
              "switches per token):", ""]  # fmt: skip
    for threads, paths in results.items():
        inproc = statistics.median(r["cpu_ms"] for r in paths["in-process"])
        lines.append(f"- {threads} thread(s): in-process {inproc:.1f} ms a token (whole process); server: "
                     f"{_fmt_threads(paths['server'])}")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        threads, seed, input_len, output_len = map(int, sys.argv[2:6])
        print(json.dumps(in_process(threads, seed, input_len, output_len)))
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--port", type=int, default=8421)
    p.add_argument("--write-docs", action="store_true")
    args = p.parse_args()
    load0 = os.getloadavg()[0]
    results = measure(args)
    doc = report(args, results, load0)
    print(doc)
    if args.write_docs:
        replace_section(DOCS, "serve-overhead", doc)


if __name__ == "__main__":
    main()

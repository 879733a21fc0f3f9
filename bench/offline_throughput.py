"""Offline throughput: edgeinfer's continuous batching vs HF transformers on the same weights and dtype.

Gemma 3 270M (default model, dequantized to bf16). 128-token prompts; output lengths drawn uniformly in
[16, 256] with a fixed seed; EOS ignored so every system produces exactly the same number of tokens.
Baselines, as a naive server would use HF: one request at a time, and static batches of the same size
(a batch runs until its longest member is done; only each request's own tokens count as output).

    .venv/bin/python bench/offline_throughput.py [--concurrency 1 8 32] [--requests 32] [--write-docs]
"""

from __future__ import annotations

import argparse
import platform
import random
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from edgeinfer.engine.config import EngineConfig
from edgeinfer.engine.engine import LLMEngine
from edgeinfer.types import SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
from docs_table import replace_section


@dataclass
class Result:
    system: str
    concurrency: int
    requests: int
    output_tokens: int
    seconds: float
    steps: int

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def step_ms(self) -> float:
        return 1000 * self.seconds / max(self.steps, 1)


def workload(n: int, vocab: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(1000, vocab - 1000) for _ in range(128)], rng.randint(16, 256)) for _ in range(n)]


def run_ours(engine: LLMEngine, work, concurrency: int) -> Result:
    engine.scheduler.config = type(engine.scheduler.config)(
        **{**engine.scheduler.config.__dict__, "max_num_seqs": concurrency}
    )
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for _, n in work]
    steps_before = _steps(engine)
    t0 = time.perf_counter()
    out = engine.generate([p for p, _ in work], params)
    dt = time.perf_counter() - t0
    assert [len(o.token_ids) for o in out] == [n for _, n in work]
    return Result(
        "edgeinfer (continuous batching)",
        concurrency,
        len(work),
        sum(n for _, n in work),
        dt,
        _steps(engine) - steps_before,
    )


def _steps(engine: LLMEngine) -> int:
    return engine.runner.num_steps


def run_hf(model, work, batch: int) -> Result:
    total_tokens, steps = 0, 0
    t0 = time.perf_counter()
    for i in range(0, len(work), batch):
        group = work[i : i + batch]
        ids = torch.tensor([p for p, _ in group])
        longest = max(n for _, n in group)
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=longest,
                min_new_tokens=longest,
                do_sample=False,
                pad_token_id=0,
            )
        assert out.shape[1] == ids.shape[1] + longest
        total_tokens += sum(n for _, n in group)
        steps += longest
    dt = time.perf_counter() - t0
    name = "HF transformers, one at a time" if batch == 1 else "HF transformers, static batches"
    return Result(name, batch, len(work), total_tokens, dt, steps)


def machine() -> str:
    cpu = platform.processor() or "cpu"
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        cpu = next(
            line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name")
        )
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {torch.get_num_threads()} threads, torch {torch.__version__}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--requests", type=int, default=32, help="requests per concurrency level")
    ap.add_argument("--naive-requests", type=int, default=4, help="requests for the one-at-a-time baseline")
    ap.add_argument("--threads", type=int, default=None, help="torch threads for both systems (default: all)")
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    engine = LLMEngine(EngineConfig(dtype="bfloat16", batch_window_ms=0, enable_prefix_caching=False))
    from transformers import AutoModelForCausalLM

    gguf = engine.checkpoint.gguf_path
    hf = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16
    ).eval()
    vocab = engine.model.args.vocab_size
    work = workload(args.requests, vocab)
    rows: list[Result] = []
    rows.append(run_hf(hf, work[: args.naive_requests], 1))
    for c in args.concurrency:
        run_ours(engine, work[: min(4, len(work))], c)  # warm-up
        rows.append(run_ours(engine, work, c))
        if c > 1:
            rows.append(run_hf(hf, work, c))
    table = render(rows, args)
    print(table)
    if args.write_docs:
        replace_section(Path(__file__).parents[1] / "docs" / "benchmarks.md", "offline-throughput", table)


def render(rows: list[Result], args) -> str:
    naive = rows[0].tok_s
    lines = [
        "### Offline throughput, Gemma 3 270M (bf16)",
        "",
        f"Machine: {machine()}. Command: `.venv/bin/python bench/offline_throughput.py "
        f"--concurrency {' '.join(map(str, args.concurrency))} --requests {args.requests} "
        f"--naive-requests {args.naive_requests}{f' --threads {args.threads}' if args.threads else ''} "
        "--write-docs`. "
        "128-token prompts, output lengths uniform in [16, 256] (seed 0), EOS ignored.",
        "",
        "| system | concurrency | requests | output tokens | output tok/s | mean step ms "
        "| × one-at-a-time HF |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.system} | {r.concurrency} | {r.requests} | {r.output_tokens} | {r.tok_s:.1f} | "
            f"{r.step_ms:.1f} | {r.tok_s / naive:.2f} |"
        )
    ours = {r.concurrency: r for r in rows if r.system.startswith("edgeinfer")}
    static = {r.concurrency: r for r in rows if "static" in r.system}
    notes = [f"at {c}: {ours[c].tok_s / static[c].tok_s:.2f}× HF static batches" for c in static if c in ours]
    if notes:
        lines += ["", "edgeinfer vs static batching of the same size: " + "; ".join(notes) + "."]
    return "\n".join(lines)


if __name__ == "__main__":
    main()

"""Decode from lossless resident weights (`--weights lossless`, kernels/lossless.py) against bf16, in one run:
resident weight bytes, single-stream decode tok/s and 32-concurrent decode tok/s.

Gemma 3 270M (the default model: bf16 from its GGUF), or the bf16 checkpoint `--model` names (the MoE
benchmark's GLM-4.5-shaped model: bench/moe_vs_llamacpp.py builds it under bench/.peers/moe/glm45/hf),
in-process, one engine per weight form, each at the process's default thread count, taking turns
`--rounds` times. Single stream: one random prompt, the rate of
the steps after its first token (each one token through the fused decode step). Concurrent: `--concurrency`
prompts at once, decode tokens over the time from the last prompt's first token to the end. Both forms give
the same tokens (checked). Below the table: the products alone (`bf16_gemv` vs `lossless_gemv`) on the
lm_head's shape, one row and 32, best of a few calls.

    .venv/bin/python bench/lossless_weights.py [--model DIR] [--tokens 32] [--rounds 3] [--concurrency 32]
        [--write-docs]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from edgeinfer.engine.config import EngineConfig
from edgeinfer.engine.engine import LLMEngine
from edgeinfer.engine.kernels import lossless, ops
from edgeinfer.types import EngineRequest, SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
import peers
from docs_table import replace_section

DOCS = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"
FORMS = ("bf16", "lossless")


def engine_for(weights: str, model: str | None = None) -> LLMEngine:
    """No step-time budget or batch window: prefills in full chunks, decode steps at once."""
    config = EngineConfig(weights=weights, max_step_ms=None, shared_step_ms=None, batch_window_ms=0)
    return LLMEngine(config if model is None else dataclasses.replace(config, model=model))


def decode_rate(engine: LLMEngine, prompts: list[list[int]], tokens: int, tag: str) -> tuple[float, list]:
    """Decode tokens per second once every prompt has its first token, and the tokens produced."""
    sp = SamplingParams(max_tokens=tokens + 1, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(EngineRequest(f"{tag}-{i}", prompt, sp))
    started: set[str] = set()
    produced, start = 0, None
    out: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        outputs = engine.step()
        for o in outputs:
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
            if start is not None:
                produced += len(o.new_token_ids)
            started.add(o.request_id)
        if start is None and len(started) == len(prompts):
            start = time.perf_counter()
    assert start is not None
    return produced / (time.perf_counter() - start), [out[k] for k in sorted(out)]


def measure(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    engines = {form: engine_for(form, args.model) for form in FORMS}
    vocab = min(200_000, engines["bf16"].model.args.vocab_size)
    rng = random.Random(7)
    prompt = [rng.randrange(vocab // 100, vocab) for _ in range(args.prompt)]
    many = [[rng.randrange(vocab // 100, vocab) for _ in range(args.prompt)] for _ in range(args.concurrency)]
    for form, engine in engines.items():
        assert form == "bf16" or engine.runner.fused is not None, "the lossless model left the fused step"
        decode_rate(engine, [prompt[:16]], 8, "warm-up")
    rates: dict[str, dict[str, list[float]]] = {f: {"one": [], "many": []} for f in FORMS}
    answers: dict[str, list] = {}
    for r in range(args.rounds):
        for form, engine in engines.items():
            one, answers[form] = decode_rate(engine, [prompt], args.tokens, f"one{r}")
            batched, _ = decode_rate(engine, many, args.tokens, f"many{r}")
            rates[form]["one"].append(one)
            rates[form]["many"].append(batched)
            print(f"round {r} {form}: {one:.1f} tok/s alone, {batched:.1f} tok/s at {len(many)}", flush=True)
    assert answers["lossless"] == answers["bf16"], "the lossless form changed the greedy tokens"
    return {
        form: {
            "one": statistics.median(rates[form]["one"]),
            "many": statistics.median(rates[form]["many"]),
            "bytes": engine.layout.weight_bytes,
        }
        for form, engine in engines.items()
    }


def best_ms(call: Callable[[], object], repeats: int) -> float:
    call()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def kernel_line(repeats: int = 5) -> str:
    """`bf16_gemv` vs `lossless_gemv` on the lm_head's shape (262,144 x 640), one row and 32."""
    w = (torch.randn(262_144, 640) * 0.03).bfloat16()
    form = lossless.encode(w).tensors().values()
    parts = []
    for rows in (1, 32):
        x = torch.randn(rows, 640).bfloat16()
        plain = best_ms(lambda x=x: ops.bf16_gemv(x, w), repeats)
        packed = best_ms(lambda x=x: ops.lossless_gemv(x, *form), repeats)
        parts.append(
            f"{rows} row{'s' if rows > 1 else ''}: {plain:.1f} / {packed:.1f} ms ({plain / packed:.2f}x)"
        )
    return (
        "Products alone on the lm_head's shape (262,144 x 640, random weights), bf16 / lossless: "
        f"{'; '.join(parts)}."
    )


def table(rows: dict[str, dict[str, float]], args: argparse.Namespace, load: float, kernel: str) -> str:
    flags = " ".join(
        sorted(peers.cpu_flags() & {"avx2", "avx512f", "avx512_vbmi2", "avx512_bf16", "amx_tile"})
    )
    base = rows["bf16"]
    lines = [
        f"### Lossless resident weights against bf16{'' if args.model is None else ', ' + model_name(args)}, "
        f"{peers.cpu_family()} CPU",
        "",
        f"Machine: {peers.cpuinfo_field('model name')}, {os.cpu_count()} CPUs ({flags}), the default thread "
        f"count; 1-min load average {load:.1f} before (the machine is shared with other work).",
        f"Model: {model_name(args)}, in-process, one engine per weight form, taking turns; "
        f"{args.tokens} tokens decoded after a {args.prompt}-token random prompt, alone and "
        f"{args.concurrency} at once; median of {args.rounds} rounds; the greedy tokens are the same.",
        f"Command: `.venv/bin/python bench/lossless_weights.py{model_flag(args)} --write-docs`",
        "",
        "| weights | resident weight bytes | vs bf16 | decode alone (tok/s) | vs bf16 "
        f"| decode, {args.concurrency} at once (tok/s) | vs bf16 |",
        "|---|---|---|---|---|---|---|",
    ]
    for form, r in rows.items():
        lines.append(
            f"| {form} | {r['bytes']:,} | {r['bytes'] / base['bytes']:.1%} | {r['one']:.1f} "
            f"| {r['one'] / base['one']:.2f}x | {r['many']:.1f} | {r['many'] / base['many']:.2f}x |"
        )
    return "\n".join([*lines, "", kernel] if kernel else lines)


def model_label(args: argparse.Namespace) -> str:
    """The `--model` directory's parent's name (bench/.peers/moe/glm45/hf -> glm45)."""
    return Path(args.model).resolve().parent.name


def model_name(args: argparse.Namespace) -> str:
    if args.model is None:
        return "Gemma 3 270M (bf16 from its GGUF)"
    return f"`{model_label(args)}` ({args.model}, bf16)"


def model_flag(args: argparse.Namespace) -> str:
    return "" if args.model is None else f" --model {args.model}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a bf16 checkpoint directory (default: the default model)")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args()
    load = os.getloadavg()[0]
    rows = measure(args)
    # the products alone on Gemma's lm_head: under the default model's table only
    text = table(rows, args, load, kernel_line() if args.model is None else "")
    print(text)
    if args.write_docs:
        name = "" if args.model is None else f"-{model_label(args)}"
        replace_section(DOCS, f"lossless-weights{name}-{peers.cpu_family()}", text)


if __name__ == "__main__":
    main()

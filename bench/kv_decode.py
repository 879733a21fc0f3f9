"""Single-stream decode over a bf16, an int8 and an fp8 (e4m3) KV cache, in one run: tok/s with ~4k tokens
of context and how many such sequences the same KV memory holds, with bf16 and int4 weights.

Gemma 3 270M (the default model: bf16 from its GGUF, and int4 weights) in-process, one engine per KV dtype,
each at the process's default thread count. Every engine decodes the same random prompt (`--context`
tokens); the decode rate is the steps after the first token, each one token, all of them through the fused
decode step (the script checks it). The engines of one weight kind take turns, `--rounds` times; a later
round's prompt hits the prefix cache, so only its decode is repeated. Capacity: the default KV budget
(512 MiB) in blocks, as the engine sizes it. Below the table: `paged_decode` alone on one layer of Gemma 3's
shape (4 query heads per KV head of 256), one sequence a call, each call another sequence's blocks (so its
keys come from memory, as in a decode step, whose weights pass through the caches between two layers'
attention).

    .venv/bin/python bench/kv_decode.py [--context 4096] [--tokens 64] [--rounds 5] [--write-docs]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from edgeinfer.engine.attention.storage import KVCacheStorage, KVSpec
from edgeinfer.engine.config import EngineConfig
from edgeinfer.engine.engine import LLMEngine
from edgeinfer.engine.kernels import ops
from edgeinfer.types import EngineRequest, SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
import peers
from docs_table import replace_section

DOCS = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"
KV_DTYPES = {"bf16": "auto", "int8": "int8", "fp8 (e4m3)": "fp8_e4m3"}


def engine_for(kv_cache_dtype: str, quantization: str | None) -> LLMEngine:
    """No step-time budget or batch window: a lone request's prefill in full chunks, its decode at once."""
    config = EngineConfig(
        kv_cache_dtype=kv_cache_dtype,
        quantization=quantization,
        max_step_ms=None,
        shared_step_ms=None,
        batch_window_ms=0,
    )
    return LLMEngine(config)


class FusedSteps:
    """Counts the steps the fused decode step takes (it must take every decode step measured)."""

    def __init__(self, engine: LLMEngine) -> None:
        assert engine.runner.fused is not None, "this KV dtype left the fused decode step"
        self.inner, self.count = engine.runner.fused, 0
        engine.runner.fused = self

    def __call__(self, *args):
        self.count += 1
        return self.inner(*args)


def decode_rate(engine: LLMEngine, fused: FusedSteps, prompt: list[int], tokens: int, rid: str) -> float:
    """Tokens per second over the decode steps after the first token."""
    sp = SamplingParams(max_tokens=tokens + 1, temperature=0.0, ignore_eos=True)
    engine.add_request(EngineRequest(rid, prompt, sp))
    produced, elapsed, steps, fused_before = 0, 0.0, 0, fused.count
    while engine.has_unfinished_requests():
        decoding = produced > 0
        t0 = time.perf_counter()
        outputs = engine.step()
        if decoding:
            elapsed += time.perf_counter() - t0
            steps += 1
        produced += sum(len(o.new_token_ids) for o in outputs)
    assert fused.count - fused_before >= steps, "a decode step left the fused path"
    return steps / elapsed


def measure(context: int, tokens: int, rounds: int, quantization: str | None) -> dict[str, dict[str, float]]:
    rng = random.Random(7)
    prompt, warm_up = ([rng.randrange(1000, 200_000) for _ in range(n)] for n in (context, 64))
    engines = {name: engine_for(kv, quantization) for name, kv in KV_DTYPES.items()}
    counters = {name: FusedSteps(e) for name, e in engines.items()}
    rates: dict[str, list[float]] = {name: [] for name in engines}
    # first-use costs (page faults, the kernels' first calls) out of the way
    for name, engine in engines.items():
        decode_rate(engine, counters[name], warm_up, 8, "warm-up")
    for r in range(rounds):
        for name, engine in engines.items():
            rates[name].append(decode_rate(engine, counters[name], prompt, tokens, f"r{r}"))
            print(f"round {r} {name}: {rates[name][-1]:.1f} tok/s", flush=True)
    return {
        name: {
            "rate": statistics.median(rates[name]),
            "bytes": e.layout.kv_bytes_per_token,
            "tokens": e.layout.num_kv_blocks * e.layout.block_size,
            "seqs": e.layout.num_kv_blocks * e.layout.block_size // (context + tokens),
        }
        for name, e in engines.items()
    }


def kernel_us(kv_cache_dtype: str, context: int, threads: int, sequences: int = 48) -> float:
    """Median µs of one `paged_decode` call of one sequence, `sequences` of them taking turns."""
    width = -(-context // 16)
    spec = KVSpec(1, 1, 256, 1, 256)
    storage = KVCacheStorage(spec, sequences * width, 16, torch.bfloat16, torch.device("cpu"), kv_cache_dtype)
    slots = torch.arange(16, (1 + sequences * width) * 16)
    g = torch.Generator().manual_seed(0)
    storage.write(0, slots, *(torch.randn(len(slots), 1, 256, generator=g).bfloat16() for _ in "kv"))
    tables = torch.arange(1, 1 + sequences * width).reshape(sequences, 1, width).unbind(0)
    q, lens = torch.randn(1, 4, 256, generator=g).bfloat16(), torch.tensor([context])
    k_pool, v_pool, k_scales, v_scales = storage.kernel_pools(0)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        runs = []
        for _ in range(6):  # the first a warm-up
            t0 = time.perf_counter()
            for table in tables:
                ops.paged_decode(q, k_pool, v_pool, table, lens, 1 / 16, 0, k_scales, v_scales)
            runs.append((time.perf_counter() - t0) / sequences * 1e6)
    finally:
        torch.set_num_threads(before)
    return statistics.median(runs[1:])


def kernel_line(context: int) -> str:
    """`paged_decode` alone at one thread and at the default count, per KV dtype, as a sentence."""
    threads = sorted({1, torch.get_num_threads()})
    parts = []
    for t in threads:
        times = " / ".join(f"{kernel_us(kv, context, t):.0f}" for kv in KV_DTYPES.values())
        parts.append(f"{times} µs at {t} thread{'s' if t > 1 else ''}")
    return (
        f"`paged_decode` alone, one layer of Gemma 3's shape at {context:,} keys, its keys from memory "
        f"(each call another sequence's blocks), {' / '.join(KV_DTYPES)}: {'; '.join(parts)}."
    )


Rows = dict[tuple[str, str], dict[str, float]]


def table(rows: Rows, args: argparse.Namespace, load: float, kernel: str) -> str:
    flags = " ".join(
        sorted(peers.cpu_flags() & {"avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile"})
    )
    lines = [
        f"### KV cache dtypes: one stream's decode at {args.context:,} tokens of context, "
        f"{peers.cpu_family()} CPU",
        "",
        f"Machine: {peers.cpuinfo_field('model name')}, {os.cpu_count()} CPUs ({flags}), the default thread "
        f"count; 1-min load average {load:.1f} before (the machine is shared with other work).",
        "Model: Gemma 3 270M, in-process, one engine per KV dtype, those of one weight kind taking turns; "
        f"{args.tokens} tokens decoded after a {args.context:,}-token random prompt, every step through the "
        f"fused decode step; median of {args.rounds} rounds. Capacity: what the default KV budget (512 MiB) "
        "holds.",
        "Command: `.venv/bin/python bench/kv_decode.py --write-docs`",
        "",
        "| weights | KV cache | decode (tok/s) | vs bf16 KV | bytes a token (all layers, with scales) "
        f"| tokens in 512 MiB | vs bf16 KV | sequences of {args.context + args.tokens:,} tokens |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (weights, kv), r in rows.items():
        base = rows[(weights, "bf16")]
        lines.append(
            f"| {weights} | {kv} | {r['rate']:.1f} | {r['rate'] / base['rate']:.2f}x | {r['bytes']:,} "
            f"| {r['tokens']:,} | {r['tokens'] / base['tokens']:.2f}x | {r['seqs']} |"
        )
    return "\n".join([*lines, "", kernel])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args()
    load = os.getloadavg()[0]
    rows: Rows = {}
    for weights, quantization in (("bf16", None), ("int4", "int4")):
        measured = measure(args.context, args.tokens, args.rounds, quantization)
        rows |= {(weights, kv): r for kv, r in measured.items()}
    text = table(rows, args, load, kernel_line(args.context))
    print(text)
    if args.write_docs:
        replace_section(DOCS, f"kv-dtype-decode-{peers.cpu_family()}", text)


if __name__ == "__main__":
    main()

"""Measure a node profile for the fleet simulator from our engine on this machine.

One node is one core: torch runs one thread, and every time is the process's CPU time
(`time.process_time`), so other work on a shared machine slows the run but not the numbers.

Per model variant: cold-load time (engine construction), prefill time against prompt length (fit: overhead +
tokens / throughput), decode step time against batch size and context (fit: base + per_seq x batch +
per_kctx x total context / 1000), and the memory a resident copy takes (weights + KV pool).

    .venv/bin/python bench/fleet_profile.py [--variants bf16 int8] [--out PROFILE.json]
    .venv/bin/python bench/fleet_profile.py --model tiny=PATH --variants fp32 --out tiny.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch

from edgeinfer.engine.config import DEFAULT_MODEL, EngineConfig
from edgeinfer.engine.engine import LLMEngine
from edgeinfer.engine.runtime import start_runtime
from edgeinfer.types import EngineRequest, SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
from offline_throughput import machine

OUT = Path(__file__).parents[1] / "src/edgeinfer/fleet/profiles/cpu-epyc-zen4.json"
VARIANTS = {"bf16": {"dtype": "bfloat16"}, "int8": {"quantization": "int8"}, "fp32": {"dtype": "float32"}}
PROMPTS = (64, 256, 1024)
BATCHES = (1, 4, 16)
CONTEXTS = (128, 512)
DECODE_STEPS = 10
MAX_DECODE = 256  # tokens a timed request may decode (it is aborted once its steps are timed)
REPEATS = 3
# Process CPU time by default (other work on a shared machine does not count); `measure(wall=True)` times
# wall-clock instead, for comparing with a fleet running on this machine as it is.
_clock = time.process_time


def load(variant: str, model: str = DEFAULT_MODEL) -> tuple[LLMEngine, float]:
    started = _clock()
    start_runtime(threads=1)  # one node = one core (the default is every core)
    config = EngineConfig(
        model=model,
        batch_window_ms=0,
        enable_prefix_caching=False,
        max_num_batched_tokens=16384,
        **VARIANTS[variant],
    )
    engine = LLMEngine(config)
    return engine, _clock() - started


def _add(engine: LLMEngine, rng: random.Random, prompt: int, max_tokens: int) -> str:
    vocab = engine.model.args.vocab_size
    ids = [rng.randrange(vocab // 20, vocab) for _ in range(prompt)]
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return engine.add_request(EngineRequest(f"r{rng.random()}", ids, sp, arrival_time=engine.clock()))


def _drain(engine: LLMEngine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def prefill_times(engine: LLMEngine, rng: random.Random) -> list[tuple[int, float]]:
    """Median of REPEATS prefills per prompt length: a step's first-call costs (new shapes, allocations,
    a collection) would otherwise dominate a small model's times."""
    rows = []
    for n in PROMPTS:
        times = []
        for _ in range(REPEATS):
            _add(engine, rng, n, 1)
            started = _clock()
            _drain(engine)  # one step: the prompt's prefill, whose sample is the only token
            times.append(_clock() - started)
        rows.append((n, float(np.median(times))))
    return rows


def step_times(engine: LLMEngine, rng: random.Random) -> list[tuple[int, int, float]]:
    """Median decode step time per (batch, context), each step timed alone (same reason as above)."""
    rows = []
    for batch in BATCHES:
        for context in CONTEXTS:
            # room to decode through the prefills of the rest of the batch, then aborted once timed
            ids = [_add(engine, rng, context, MAX_DECODE) for _ in range(batch)]
            _finish_prefills(engine)
            engine.step()  # first decode step of the whole batch (warm-up)
            times = []
            for _ in range(DECODE_STEPS):
                started = _clock()
                engine.step()
                times.append(_clock() - started)
            assert len(engine.scheduler.running) == batch, "a request finished before the timing ended"
            rows.append((batch, context, float(np.median(times))))
            for rid in ids:
                engine.abort(rid)
    return rows


def _finish_prefills(engine: LLMEngine) -> None:
    """Step until every request is past its prompt: the scheduler's step-time budget spreads a batch's
    prefills over several steps, each shared with the decodes of those already through (timed as decode
    steps, they made a batch of 4 at 512 tokens look 6x slower than it is)."""
    scheduler = engine.scheduler
    while len(scheduler.waiting) or any(r.is_prefilling for r in scheduler.running):
        engine.step()


def fit(prefill: list[tuple[int, float]], steps: list[tuple[int, int, float]]) -> dict[str, float]:
    n = np.array([r[0] for r in prefill], dtype=float)
    t = np.array([r[1] for r in prefill])
    slope, intercept = np.polyfit(n, t, 1)
    if slope <= 0:
        # A model so small that its prefill time does not grow over these prompts: all overhead.
        slope, intercept = 0.0, float(t.mean())
    a = np.array([[1.0, b, b * c / 1000] for b, c, _ in steps])
    coef, *_ = np.linalg.lstsq(a, np.array([s for *_, s in steps]), rcond=None)
    return {
        "prefill_tok_s": round(1 / slope, 1) if slope else 1e9,
        "prefill_overhead_ms": round(max(0.0, intercept) * 1000, 2),
        "step_base_ms": round(max(0.0, coef[0]) * 1000, 3),
        "step_per_seq_ms": round(max(0.0, coef[1]) * 1000, 3),
        "step_per_kctx_ms": round(max(0.0, coef[2]) * 1000, 3),
    }


def profile(variant: str, model: str = DEFAULT_MODEL) -> tuple[dict, dict]:
    engine, load_s = load(variant, model)
    rng = random.Random(0)
    _add(engine, rng, 32, 2)  # warm-up: first-call costs stay out of the fits
    _drain(engine)
    prefill, steps = prefill_times(engine, rng), step_times(engine, rng)
    layout = engine.layout
    entry = {
        **fit(prefill, steps),
        "load_s": round(load_s, 2),
        "weights_gb": round(layout.weight_bytes / 1e9, 4),
        "kv_tokens": layout.num_kv_blocks * engine.config.block_size,
        "kv_gb": round(layout.kv_bytes / 1e9, 4),
    }
    raw = {"prefill_s": prefill, "decode_step_s": steps}
    return entry, raw


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument(
        "--model", default=None, metavar="NAME=PATH", help=f"a local checkpoint ({DEFAULT_MODEL})"
    )
    args = ap.parse_args()
    name, _, path = (args.model or f"{DEFAULT_MODEL}={DEFAULT_MODEL}").partition("=")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(measure(name, path or name, args.variants), indent=1) + "\n")
    print(f"wrote {args.out}")


def measure(name: str, model: str, variants: list[str], wall: bool = False) -> dict:
    """The profile document of `model` (a checkpoint name or path) in each variant, on one thread."""
    global _clock
    _clock = time.perf_counter if wall else time.process_time
    torch.set_num_threads(1)
    models, measurements = {}, {}
    for variant in variants:
        key = f"{name}-{variant}"
        models[key], measurements[key] = profile(variant, model)
        print(key, json.dumps(models[key]), flush=True)
    return {
        "device": f"one core of {machine()}",
        "source": "measured by bench/fleet_profile.py with edgeinfer's engine, "
        f"{'wall-clock' if wall else 'process CPU'} time "
        f"(1-min load average {os.getloadavg()[0]:.1f} at the end)",
        "models": models,
        "measurements": measurements,
    }


if __name__ == "__main__":
    main()

"""Micro-benchmarks of the quantized linear kernels.

    python bench/quant_linears.py [--threads 1] [--repeats 20]

Prints a markdown table: milliseconds per call (best of `repeats`, so shared-machine noise inflates
nothing), for each (out x in) shape, tokens M, and method. Numbers are for docs/quantization.md, never
for assertions.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from edgeinfer.engine.quant.layers import QuantLinear

SHAPES = [(2048, 640), (640, 2048), (262144, 640)]  # Gemma 3 270M: gate/up, down, lm_head
TOKENS = [1, 8, 32]
METHODS = ["int8", "int4", "fp8"]


def best_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up (allocations, lazy init)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def bench_linear(out_f: int, in_f: int, repeats: int) -> list[str]:
    w = torch.randn(out_f, in_f) * 0.02
    w_bf16 = w.to(torch.bfloat16)
    layers = {m: QuantLinear.from_float(w, None, m) for m in METHODS}
    reps = max(3, repeats // 10) if out_f * in_f > 1e8 else repeats
    rows = []
    for m_tokens in TOKENS:
        x = torch.randn(m_tokens, in_f).to(torch.bfloat16)
        base = best_ms(lambda x=x: F.linear(x, w_bf16), reps)
        cells = [f"{base:.3f}"]
        for method in METHODS:
            t = best_ms(lambda x=x, layer=layers[method]: layer(x), reps)
            cells.append(f"{t:.3f} ({base / t:.2f}x)")
        rows.append(f"| {out_f}x{in_f} | {m_tokens} | " + " | ".join(cells) + " |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cpu = torch.backends.cpu.get_cpu_capability()
    print(f"torch {torch.__version__}, {args.threads} thread(s), CPU capability {cpu}")
    print("| out x in | M | bf16 ms | int8 ms (speed-up) | int4 ms | fp8 ms |")
    print("|---|---|---|---|---|---|")
    for out_f, in_f in SHAPES:
        print("\n".join(bench_linear(out_f, in_f, args.repeats)), flush=True)


if __name__ == "__main__":
    main()

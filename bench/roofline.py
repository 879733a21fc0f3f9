"""Roofline for decoding Gemma 3 270M on this machine: the best tok/s memory bandwidth and bf16 compute allow.

A decode step reads every weight once (shared by the whole batch) plus each sequence's KV cache, and does
about 2 FLOPs per weight per sequence. So at batch B the step takes at least
    max((weight_bytes + B * kv_bytes_per_seq) / bandwidth, B * flops_per_token / peak_flops)
and the ceiling is B tokens per such step. Both machine numbers are measured here with torch (best of several
runs, all cores), so the ceiling is what this box could do, not a datasheet figure.

    python bench/roofline.py [--context 192] [--batches 1 8 32 64] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class ModelShape:
    """Decoder shape; defaults are Gemma 3 270M (its GGUF metadata: 18 layers, 640 wide, 1 KV head of 256)."""

    vocab: int = 262_144
    hidden: int = 640
    layers: int = 18
    ffn: int = 2048
    heads: int = 4
    kv_heads: int = 1
    head_dim: int = 256
    sliding_window: int = 512
    global_every: int = 6  # every 6th layer attends globally, the other five within the sliding window

    @property
    def layer_params(self) -> int:
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)  # q, o, k, v
        return attn + 3 * self.hidden * self.ffn  # gate, up, down

    @property
    def matmul_params(self) -> int:
        """Weights every decode step multiplies: all layers plus the (tied) vocabulary projection."""
        return self.layers * self.layer_params + self.vocab * self.hidden

    def kv_tokens_read(self, context: int) -> int:
        """Token positions whose K and V one decode step reads, summed over layers."""
        n_global = self.layers // self.global_every
        return n_global * context + (self.layers - n_global) * min(context, self.sliding_window)

    def kv_bytes_per_seq(self, context: int, kv_bytes: float = 2.0) -> float:
        return self.kv_tokens_read(context) * 2 * self.kv_heads * self.head_dim * kv_bytes

    def flops_per_token(self, context: int) -> float:
        # 2 per multiply-add in the matmuls, plus QK^T and PV over the context for each query head.
        per_layer_ctx = self.kv_tokens_read(context) * 4 * self.heads * self.head_dim
        return 2.0 * self.matmul_params + per_layer_ctx


# Bytes per weight: Q8_0 stores 32 int8 + one fp16 scale; int4 with a bf16 scale per group of 32.
PRECISIONS: dict[str, float] = {"bf16": 2.0, "int8": 34 / 32, "int4": 18 / 32}


def _best_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm caches and thread pools
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_bandwidth(mib: int = 256, repeats: int = 10) -> dict[str, float]:
    """Memory bandwidth in GB/s: a read-only sum and a copy (read + write) of a `mib` MiB fp32 tensor."""
    x = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
    y = torch.empty_like(x)
    nbytes = x.numel() * 4
    read = nbytes / _best_seconds(lambda: x.sum(), repeats) / 1e9
    copy = 2 * nbytes / _best_seconds(lambda: y.copy_(x), repeats) / 1e9
    return {"read_gbs": read, "copy_gbs": copy}


def measure_matmul(n: int = 2048, repeats: int = 5) -> dict[str, float]:
    """Peak matmul throughput in GFLOP/s for square bf16 and fp32 products of side `n`."""
    out = {}
    for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        out[f"{name}_gflops"] = 2 * n**3 / _best_seconds(lambda a=a, b=b: a @ b, repeats) / 1e9
    return out


def decode_ceiling(
    shape: ModelShape, batch: int, context: int, bytes_per_weight: float, bandwidth_gbs: float, gflops: float
) -> float:
    """Best possible decode tok/s at `batch` sequences of `context` tokens (KV in bf16)."""
    step_bytes = shape.matmul_params * bytes_per_weight + batch * shape.kv_bytes_per_seq(context)
    step_flops = batch * shape.flops_per_token(context)
    step_s = max(step_bytes / (bandwidth_gbs * 1e9), step_flops / (gflops * 1e9))
    return batch / step_s


def roofline(context: int, batches: list[int], threads: int | None = None) -> dict[str, object]:
    """Measure the machine with `threads` (default: all cores); ceilings per precision and batch size."""
    torch.set_num_threads(threads or os.cpu_count() or 1)
    shape = ModelShape()
    machine = {**measure_bandwidth(), **measure_matmul(), "threads": torch.get_num_threads()}
    # A single-stream sum can be limited by the core, not DRAM; the best of the two is the bandwidth.
    machine["bandwidth_gbs"] = bandwidth = max(machine["read_gbs"], machine["copy_gbs"])
    ceilings = {
        prec: {b: decode_ceiling(shape, b, context, bpw, bandwidth, machine["bf16_gflops"]) for b in batches}
        for prec, bpw in PRECISIONS.items()
    }
    return {"machine": machine, "model": asdict(shape), "matmul_params": shape.matmul_params,
            "context": context, "ceilings_tok_s": ceilings}  # fmt: skip


def summary_line(result: dict[str, object]) -> str:
    """One sentence for docs/benchmarks.md."""
    m, c = result["machine"], result["ceilings_tok_s"]
    batches = list(c["bf16"])
    parts = [f"{p} " + " / ".join(f"{c[p][b]:,.0f}" for b in batches) for p in c]
    return (
        f"Roofline: {m['bandwidth_gbs']:.1f} GB/s memory bandwidth, "
        f"{m['bf16_gflops']:.0f} GFLOP/s bf16 matmul ({m['threads']} thread(s)) → "
        "best possible Gemma 3 270M decode tok/s at batch "
        f"{' / '.join(map(str, batches))} (context {result['context']}): " + "; ".join(parts) + "."
    )


def main() -> int:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--context", type=int, default=192, help="mean tokens in context while decoding")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--threads", type=int, default=None, help="default: all cores")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.context < 1 or any(b < 1 for b in args.batches):
        parser.error("--context and --batches must be >= 1")
    result = roofline(args.context, args.batches, args.threads)
    print(json.dumps(result["machine"], indent=2))
    print(summary_line(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Long prompts, edgeinfer against llama-server in one run: time to first token at 1k, 4k, 12k and 30k prompt
tokens (one request, `max_tokens: 1`, a fresh random prompt each, so no prompt cache helps), decode speed
with 16k tokens of context, and how many 32k-token sequences our default KV memory holds with the hybrid
KV cache (sliding-window layers keep only their window's blocks) and without it.

Gemma 3 270M at bf16 on both sides: ours `edgeinfer serve` with no flags but the port (bf16 from the
default Q4_K_M GGUF), llama-server on the BF16 GGUF llama-quantize makes of the same file, one slot of
32k + 256 tokens, flash attention on; each server at its own default thread count, one at a time.

    .venv/bin/python bench/long_context.py [--lengths 1024 4096 12288 30720] [--write-docs]
    .venv/bin/python bench/long_context.py --capacity-only   # the KV arithmetic alone, no servers
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).parent))
import peers
from docs_table import replace_section
from serve_vs_llamacpp import our_server

from edgeinfer.engine.config import EngineConfig
from edgeinfer.engine.kv_cache import KVCacheManager
from edgeinfer.engine.loading import plan_layout, resolve_dtype
from edgeinfer.engine.model.loader import open_checkpoint
from edgeinfer.engine.model.loader.default_model import resolve_default_model
from edgeinfer.engine.model.registry import build_model

DOCS = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"
PORT = 8571
DECODE_CONTEXT, DECODE_TOKENS = 16_384, 64
CAPACITY_TOKENS = 32_768


def prompt_ids(n: int, seed: int) -> list[int]:
    """Token ids of ordinary vocabulary entries (no special tokens), the same on both servers."""
    rng = random.Random(seed)
    return [rng.randrange(1000, 200_000) for _ in range(n)]


def ttft(url: str, model: str, n: int, seed: int) -> float | str:
    """Seconds to the answer, or the server's reason for refusing the prompt."""
    body = {"model": model, "prompt": prompt_ids(n, seed), "max_tokens": 1, "temperature": 0.0}
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/completions", json=body, timeout=1800)
    if r.status_code == 400:
        return r.json()["error"]["message"]
    r.raise_for_status()
    return time.perf_counter() - t0


def decode_rate(url: str, model: str, seed: int) -> float:
    """Output tokens per second after the first, streamed, over DECODE_CONTEXT tokens of context."""
    body = {
        "model": model,
        "prompt": prompt_ids(DECODE_CONTEXT, seed),
        "max_tokens": DECODE_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
    arrivals: list[float] = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=1800) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                arrivals.append(time.perf_counter())
    return (len(arrivals) - 1) / (arrivals[-1] - arrivals[0])


def measure(url: str, model: str, lengths: list[int]) -> dict[str, float | str]:
    ttft(url, model, 256, seed=1)  # first-use costs out of the way
    row = {f"ttft_{n}": ttft(url, model, n, seed=100 + n) for n in lengths}
    row["decode"] = decode_rate(url, model, seed=7)
    return row


@dataclass(frozen=True)
class Capacity:
    """One 32k-token sequence's KV at its peak (blocks and MiB) and how many such sequences the default KV
    memory holds at once, from the layout the engine plans (loading.plan_layout) and the blocks its cache
    manager gives such a sequence while its prompt is prefilled a full step at a time."""

    blocks: int
    layers_per_block: int
    mib: float
    sequences: int


def kv_capacity(gguf: Path, hybrid: bool) -> Capacity:
    ckpt = open_checkpoint(str(gguf))
    with torch.device("meta"):  # the layout needs the model's shape, not its weights
        model = build_model(ckpt.config)
    config = EngineConfig(model=str(gguf), hybrid_kv_cache=hybrid)
    layout = plan_layout(config, model, resolve_dtype(config.dtype, torch.device(config.device)))
    kv = KVCacheManager(layout.num_kv_blocks, layout.block_size, windows=layout.kv_groups.windows)
    blocks = kv.peak_blocks(CAPACITY_TOKENS, config.max_num_batched_tokens)
    mib = blocks * layout.kv_block_bytes / 2**20
    return Capacity(blocks, layout.kv_groups.slots, mib, layout.num_kv_blocks // blocks)


def capacity_lines(before: Capacity, after: Capacity) -> list[str]:
    rows = [
        ("every layer keeps every token (`--no-hybrid-kv-cache`)", before),
        ("hybrid KV cache (windowed layers keep their window)", after),
    ]
    return [
        "| 32k-token sequences in the default KV memory (512 MiB) | KV blocks per sequence | KV per sequence "
        "| sequences |",
        "|---|---|---|---|",
        *(
            f"| {name} | {c.blocks:,} (16 tokens x {c.layers_per_block} layers each) | {c.mib:.0f} MiB "
            f"| {c.sequences} |"
            for name, c in rows
        ),
    ]


def table(
    ours: dict[str, float | str], llama: dict[str, float | str], lengths: list[int], capacity: list[str]
) -> str:
    flags = " ".join(
        sorted(peers.cpu_flags() & {"avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile"})
    )
    lines = [
        f"### Long prompts: edgeinfer vs llama.cpp, bf16, {peers.cpu_family()} CPU",
        "",
        f"Machine: {peers.cpuinfo_field('model name')}, {os.cpu_count()} CPUs ({flags}); each server at its "
        "default thread count, one at a time; 1-min load average "
        f"{os.getloadavg()[0]:.1f} after (the machine is shared with other work).",
        "Model: Gemma 3 270M. Ours: `edgeinfer serve` (bf16 from the default GGUF); llama.cpp: llama-server "
        f"(llama-cpp-python {peers.LLAMA_CPP_PYTHON_VERSION}) on the BF16 GGUF of the same file, one slot of "
        "32k + 256 tokens, flash attention on. One request at a time, a fresh random prompt each "
        "(`max_tokens: 1`); decode: 64 tokens streamed after a 16k-token prompt.",
        "Command: `.venv/bin/python bench/long_context.py --write-docs`",
        "",
        "| measure | llama.cpp | edgeinfer | ratio (edgeinfer / llama.cpp) |",
        "|---|---|---|---|",
    ]
    for n in lengths:
        key = f"ttft_{n}"
        lines.append(_row(f"TTFT at {n:,} prompt tokens (s)", llama[key], ours[key], "{:.2f}"))
    lines.append(_row("decode at 16k context (tok/s)", llama["decode"], ours["decode"], "{:.1f}"))
    return "\n".join([*lines, "", *capacity])


def _row(name: str, theirs: float | str, ours: float | str, fmt: str) -> str:
    """A table row; a refused prompt shows the server's reason in place of a time."""
    cells = [fmt.format(x) if isinstance(x, float) else f"refused: {x}" for x in (theirs, ours)]
    both = isinstance(theirs, float) and isinstance(ours, float)
    ratio = f"{ours / theirs:.2f}x" if both else ""
    return f"| {name} | {cells[0]} | {cells[1]} | {ratio} |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 12_288, 30_720])
    ap.add_argument("--write-docs", action="store_true")
    ap.add_argument("--capacity-only", action="store_true", help="print the KV capacity and stop")
    args = ap.parse_args()
    gguf = resolve_default_model()
    capacity = capacity_lines(kv_capacity(gguf, hybrid=False), kv_capacity(gguf, hybrid=True))
    print("\n".join(capacity), flush=True)
    if args.capacity_only:
        return
    peers.build()
    threads = os.cpu_count() or 1
    with our_server("gemma-3-270m", PORT, [], threads) as server:
        ours = measure(server.base_url, "gemma-3-270m", args.lengths)
    print("edgeinfer", ours, flush=True)
    with peers.llama_server(peers.peer_gguf("bf16", gguf), PORT, n_parallel=1, ctx=32_768 + 256) as server:
        llama = measure(server.base_url, "gemma-3-270m", args.lengths)
    print("llama.cpp", llama, flush=True)
    text = table(ours, llama, args.lengths, capacity)
    print(text)
    if args.write_docs:
        replace_section(DOCS, f"long-context-{peers.cpu_family()}", text)


if __name__ == "__main__":
    main()

"""LoRA adapters on the default model: output tok/s of 32 concurrent requests spread over 8 distinct
adapters against the same requests on the base alone, one stream's decode with an adapter against without,
and how long registering an adapter takes; in one run, in-process, at the default thread count.

The adapters are PEFT's, made here for Gemma 3 270M (rank `--rank` on every attention and MLP projection,
random A and B, so each changes the output); the engine is the default one (bf16 weights from the GGUF).
Each measurement alternates base and adapters `--rounds` times and keeps the median.

    .venv/bin/python bench/lora.py [--rank 16] [--rounds 3] [--write-docs]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from edgeinfer.engine.config import EngineConfig
from edgeinfer.engine.engine import LLMEngine
from edgeinfer.engine.model.loader import resolve_default_model
from edgeinfer.types import EngineRequest, SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
import peers
from docs_table import replace_section

DOCS = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS, CONCURRENT, PROMPT_TOKENS, OUTPUT_TOKENS = 8, 32, 64, 64


def make_adapters(root: Path, rank: int) -> list[Path]:
    """`ADAPTERS` PEFT adapters of the default model, each with its own random A and B."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    gguf = resolve_default_model()
    base = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, init_lora_weights=False)
    model = get_peft_model(base, config)
    paths = []
    for i in range(ADAPTERS):
        torch.manual_seed(i)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.normal_(0.0, 0.02)
        paths.append(root / f"adapter-{i}")
        model.save_pretrained(paths[-1])
    return paths


def run(
    engine: LLMEngine, prompts: list[list[int]], adapters: list[str | None], tag: str
) -> tuple[float, float]:
    """All prompts at once to the end: (output tok/s over the whole run, tok/s of the decode steps)."""
    sp = SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0.0, ignore_eos=True)
    for i, (prompt, adapter) in enumerate(zip(prompts, adapters, strict=True)):
        engine.add_request(EngineRequest(f"{tag}-{i}", prompt, sp, adapter=adapter))
    produced = decode_tokens = 0
    decode_s = 0.0
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        s0 = time.perf_counter()
        outputs = engine.step()
        n = sum(len(o.new_token_ids) for o in outputs)
        if produced >= len(prompts):  # past every first token: a decode step
            decode_s += time.perf_counter() - s0
            decode_tokens += n
        produced += n
    return produced / (time.perf_counter() - t0), decode_tokens / decode_s


def measure(args: argparse.Namespace) -> dict[str, float]:
    rng = random.Random(3)
    prompts = [[rng.randrange(1000, 200_000) for _ in range(PROMPT_TOKENS)] for _ in range(CONCURRENT)]
    engine = LLMEngine(EngineConfig(batch_window_ms=0))
    with tempfile.TemporaryDirectory() as tmp:
        paths = make_adapters(Path(tmp), args.rank)
        loads = []
        for i, path in enumerate(paths):
            t0 = time.perf_counter()
            engine.load_adapter(f"a{i}", str(path))
            loads.append(time.perf_counter() - t0)
    names = [f"a{i % ADAPTERS}" for i in range(CONCURRENT)]
    run(engine, prompts[:4], [None, "a0", None, "a1"], "warm-up")
    found: dict[str, list[float]] = {k: [] for k in ("base32", "lora32", "base1", "lora1")}
    for r in range(args.rounds):
        found["base32"].append(run(engine, prompts, [None] * CONCURRENT, f"b{r}")[0])
        found["lora32"].append(run(engine, prompts, names, f"l{r}")[0])
        found["base1"].append(run(engine, prompts[:1], [None], f"b1{r}")[1])
        found["lora1"].append(run(engine, prompts[:1], ["a0"], f"l1{r}")[1])
        print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in found.items()), flush=True)
    result = {k: statistics.median(v) for k, v in found.items()}
    result["load_ms"] = statistics.median(loads) * 1000
    return result


def table(r: dict[str, float], args: argparse.Namespace, load: float) -> str:
    flags = " ".join(
        sorted(peers.cpu_flags() & {"avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile"})
    )
    return "\n".join(
        [
            f"### LoRA adapters on the default model, {peers.cpu_family()} CPU",
            "",
            f"Machine: {peers.cpuinfo_field('model name')}, {os.cpu_count()} CPUs ({flags}), the default "
            f"thread count; 1-min load average {load:.1f} before.",
            f"Model: Gemma 3 270M (bf16 weights), in-process; {ADAPTERS} PEFT adapters of rank {args.rank} "
            "on every attention and MLP projection (random A and B). "
            f"{CONCURRENT} requests of {PROMPT_TOKENS} prompt and {OUTPUT_TOKENS} output tokens at once, "
            f"on the base alone or spread over the {ADAPTERS} adapters; one stream likewise (decode steps "
            f"only); median of {args.rounds} rounds, base and adapters taking turns.",
            "Command: `.venv/bin/python bench/lora.py --write-docs`",
            "",
            "| measure | base | with adapters | ratio | target |",
            "|---|---|---|---|---|",
            f"| {CONCURRENT} concurrent, output tok/s ({ADAPTERS} adapters) | {r['base32']:.1f} | "
            f"{r['lora32']:.1f} | {r['lora32'] / r['base32']:.2f}x | >= 0.7x |",
            f"| one stream, decode tok/s | {r['base1']:.1f} | {r['lora1']:.1f} | "
            f"{r['lora1'] / r['base1']:.2f}x | >= 0.85x |",
            "",
            f"Registering one adapter (read, checked, laid out in bf16): {r['load_ms']:.0f} ms (median of "
            f"{ADAPTERS}).",
        ]
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args()
    load = os.getloadavg()[0]
    text = table(measure(args), args, load)
    print(text)
    if args.write_docs:
        replace_section(DOCS, f"lora-{peers.cpu_family()}", text)


if __name__ == "__main__":
    main()

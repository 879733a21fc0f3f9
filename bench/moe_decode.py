"""MoE and MLA decode throughput: edgeinfer vs HF transformers on the same random weights, same dtype.

Two tiny-but-not-toy checkpoints are written to a temp dir: a Qwen3-MoE (GQA attention) and a
DeepSeek-V3 (MLA attention), both hidden 512, 8 layers, 8 heads, 32 experts of width 256, top-4.
Decode tok/s is measured after every request's prefill is done: for edgeinfer, the steps after each
request got its first token; for HF, `generate(N) - generate(1)` on a batch of equal-length prompts
(HF's default `grouped_mm` experts and SDPA attention). The MLA model runs in both decode modes
(weight absorption and expand-on-the-fly), and the latent cache is compared with expanded K/V.

    .venv/bin/python bench/moe_decode.py [--concurrency 1 8 32] [--threads 1] [--write-docs]
"""

from __future__ import annotations

import argparse
import itertools
import platform
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from edgeinfer.engine.attention.mla import get_latent_attention
from edgeinfer.engine.config import EngineConfig
from edgeinfer.engine.engine import LLMEngine
from edgeinfer.types import EngineRequest, SamplingParams

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))
from docs_table import replace_section  # noqa: E402
from helpers.tiny_models import make_tiny  # noqa: E402

_SHARED = dict(
    hidden_size=512,
    num_hidden_layers=8,
    num_attention_heads=8,
    intermediate_size=1024,
    num_experts_per_tok=4,
    moe_intermediate_size=256,
    max_position_embeddings=4096,
)
MODELS: dict[str, tuple[str, dict]] = {
    "Qwen3-MoE (GQA 8q/2kv heads × 64)": (
        "qwen3_moe",
        dict(_SHARED, num_key_value_heads=2, head_dim=64, num_experts=32, mlp_only_layers=[]),
    ),
    "DeepSeek-V3 (MLA)": (
        "deepseek_v3",
        dict(
            _SHARED,
            num_key_value_heads=8,
            q_lora_rank=256,
            kv_lora_rank=128,
            qk_nope_head_dim=64,
            qk_rope_head_dim=32,
            v_head_dim=64,
            n_routed_experts=32,
            n_group=4,
            topk_group=2,
            first_k_dense_replace=0,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        ),
    ),
}
_ids = itertools.count()


@dataclass
class Row:
    model: str
    system: str
    concurrency: int
    context: int
    tok_s: float


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, 380, (n, length), generator=gen).tolist()


def ours_decode(engine: LLMEngine, batch: list[list[int]], new_tokens: int) -> float:
    """Decode tok/s of edgeinfer with `batch` running together (steps after every prefill finished)."""
    sp = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for p in batch:
        engine.add_request(EngineRequest(f"bench-{next(_ids)}", p, sp))
    started: set[str] = set()
    while len(started) < len(batch):
        started.update(o.request_id for o in engine.step() if o.new_token_ids)
    t0, tokens = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        tokens += sum(len(o.new_token_ids) for o in engine.step())
    return tokens / (time.perf_counter() - t0)


def hf_decode(model, batch: list[list[int]], new_tokens: int) -> float:
    """Decode tok/s of HF generate on the same batch: (generate N) − (generate 1)."""
    ids = torch.tensor(batch)

    def timed(n: int) -> float:
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=0)  # fmt: skip
        return time.perf_counter() - t0

    return len(batch) * (new_tokens - 1) / (timed(new_tokens) - timed(1))


def bench_model(name: str, path: Path, args) -> tuple[list[Row], LLMEngine]:
    """Decode tok/s of every system at every concurrency, best of `args.repeats` rounds. Each round visits
    all systems in turn (and re-measures the HF one-at-a-time baseline), so a noisy minute on the shared
    machine hurts both sides instead of one ratio."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).eval()
    engine = LLMEngine(
        EngineConfig(model=str(path), dtype=args.dtype, batch_window_ms=0, enable_prefix_caching=False,
                     max_num_seqs=max(args.concurrency), max_num_batched_tokens=4096, num_kv_blocks=2048)
    )  # fmt: skip
    modes = ["absorb", "expand"] if engine.model.args.is_mla else [None]
    ours_decode(engine, prompts(2, args.prompt_len, 99), 4)  # warm-up
    best: dict[tuple[str, int], float] = {}

    def record(system: str, c: int, tok_s: float) -> None:
        best[system, c] = max(best.get((system, c), 0.0), tok_s)

    alone = prompts(1, args.prompt_len, seed=1)
    for _ in range(args.repeats):
        for c in args.concurrency:
            batch = prompts(c, args.prompt_len, seed=c)
            record("HF transformers", 1, hf_decode(hf, alone, args.new_tokens))
            if c != 1:
                record("HF transformers", c, hf_decode(hf, batch, args.new_tokens))
            for mode in modes:
                if mode:
                    engine.model.set_latent_attention(get_latent_attention(mode))
                system = "edgeinfer" + (f" ({mode})" if mode else "")
                record(system, c, ours_decode(engine, batch, args.new_tokens))
    rows = [Row(name, system, c, args.prompt_len, tok_s) for (system, c), tok_s in best.items()]
    return sorted(rows, key=lambda r: r.concurrency), engine


def mla_modes_long_context(name: str, engine: LLMEngine, args) -> list[Row]:
    """Absorb vs expand where they differ most: decode over long contexts."""
    rows = []
    batch = prompts(args.long_concurrency, args.long_context, seed=7)
    for mode in ("absorb", "expand"):
        engine.model.set_latent_attention(get_latent_attention(mode))
        tok_s = ours_decode(engine, batch, args.long_new_tokens)
        rows.append(Row(name, f"edgeinfer ({mode})", args.long_concurrency, args.long_context, tok_s))
    return rows


def cache_line(engine: LLMEngine) -> str:
    a = engine.model.args.attention
    latent = engine.layout.kv_bytes_per_token // engine.model.args.num_layers
    elem = engine.layout.dtype.itemsize
    expanded = a.num_heads * (a.nope_dim + a.rope_dim + a.v_dim) * elem
    return (
        f"MLA cache per token per layer: latent {latent} B (kv_lora_rank {a.kv_lora_rank} + rope "
        f"{a.rope_dim}) vs expanded K/V {expanded} B ({a.num_heads} heads × (k {a.nope_dim + a.rope_dim} + "
        f"v {a.v_dim})): **{latent / expanded:.3f}×** the bytes."
    )


def machine(args) -> str:
    return f"{platform.machine()} CPU, {torch.get_num_threads()} torch thread(s), torch {torch.__version__}"


NOTES = [
    "Reading the table: at 32 concurrent tokens × top-4 every step touches all 32 experts, so decode is "
    "bound by streaming expert weights and batching gains less than on a dense model. On the GQA model "
    "both systems run the same grouped expert GEMM and edgeinfer lands close to HF's static batch (which "
    "is HF's best case: edgeinfer keeps its rate while requests come and go). On MLA, HF caches latents but "
    "re-expands the whole context through `kv_b_proj` every step (our expand mode); absorbed decode skips "
    "that, hence the gap at 8 and 32 sequences and over long contexts. Absorb is the default "
    "(`--mla-mode absorb|expand`).",
]


def render(rows: list[Row], long_rows: list[Row], cache: str, args) -> str:
    hf1 = {r.model: r.tok_s for r in rows if r.system == "HF transformers" and r.concurrency == 1}
    hf_at = {(r.model, r.concurrency): r.tok_s for r in rows if r.system == "HF transformers"}
    lines = [
        f"### MoE / MLA decode, hidden 512, 8 layers, 32 experts top-4 ({args.dtype})",
        "",
        f"Machine: {machine(args)}; shared and noisy, so read ratios, not absolute numbers (best of "
        f"{args.repeats} interleaved rounds). Command: `.venv/bin/python bench/moe_decode.py "
        f"--dtype {args.dtype} --threads {args.threads} --write-docs`. Prompts of {args.prompt_len} random "
        f"tokens, {args.new_tokens} new tokens each, greedy, EOS ignored; decode phase only. HF runs its "
        "defaults (`grouped_mm` experts, SDPA attention over an expanded K/V cache) on a static batch of "
        "equal-length prompts, its best case.",
        "",
        "| model | system | concurrent | context | decode tok/s | × HF one-at-a-time | × HF same batch |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.model} | {r.system} | {r.concurrency} | {r.context} | {r.tok_s:.1f} | "
            f"{r.tok_s / hf1[r.model]:.2f} | {r.tok_s / hf_at[r.model, r.concurrency]:.2f} |"
        )
    lines += ["", f"MLA decode modes over a longer context ({args.long_context} tokens):", ""]
    lines += ["| system | concurrent | context | decode tok/s |", "|---|---|---|---|"]
    lines += [f"| {r.system} | {r.concurrency} | {r.context} | {r.tok_s:.1f} |" for r in long_rows]
    return "\n".join([*lines, "", cache, "", *NOTES])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--long-context", type=int, default=1024)
    ap.add_argument("--long-concurrency", type=int, default=8)
    ap.add_argument("--long-new-tokens", type=int, default=8)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (both systems)")
    ap.add_argument("--repeats", type=int, default=3, help="rounds over all systems; the best run counts")
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows, long_rows, cache = [], [], ""
    with tempfile.TemporaryDirectory() as tmp:
        for name, (family, overrides) in MODELS.items():
            path = make_tiny(family, Path(tmp) / family, **overrides)
            model_rows, engine = bench_model(name, path, args)
            rows += model_rows
            if engine.model.args.is_mla:
                long_rows = mla_modes_long_context(name, engine, args)
                cache = cache_line(engine)
            print("\n".join(f"{r}" for r in model_rows + long_rows), flush=True)
    table = render(rows, long_rows, cache, args)
    print(table)
    if args.write_docs:
        replace_section(ROOT / "docs" / "benchmarks.md", "moe-decode", table)


if __name__ == "__main__":
    main()

"""Structured outputs: decode time per output token (TPOT) with a JSON schema against unconstrained, and the
cost of compiling schemas, on the default Gemma 3 270M.

Both sides run in one process on the same engine, interleaved (free, JSON, free, JSON), so the ratio
holds while the machine's load drifts; absolute numbers move with the load. TPOT of a request is
(finish - first token) / (output tokens - 1), averaged over the requests of a run. Unconstrained requests
ignore EOS and generate `--max-tokens`; constrained ones stop when their JSON is complete or at
`--max-tokens`. Compile time: schema → grammar (llguidance, validated) and grammar → matcher for this
vocabulary, over the 34 schemas of the test suite and the benchmark's own.

    .venv/bin/python bench/structured.py [--concurrency 1 16] [--threads 1] [--write-docs]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import llguidance
import llguidance.hf
import torch

from edgeinfer.engine.config import EngineConfig
from edgeinfer.engine.engine import Completion, LLMEngine
from edgeinfer.structured.grammar import json_schema_grammar
from edgeinfer.types import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from docs_table import replace_section  # noqa: E402
from offline_throughput import machine  # noqa: E402
from structured_peer import peer_rows  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "people": {
            "type": "array",
            "minItems": 6,
            "maxItems": 6,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 40},
                    "field": {"type": "string", "maxLength": 40},
                    "born": {"type": "integer", "minimum": 1000, "maximum": 2025},
                },
                "required": ["name", "field", "born"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["people"],
    "additionalProperties": False,
}
QUESTIONS = [
    "List six famous scientists as JSON with their name, field and year of birth.",
    "Give six painters as JSON: name, style as field, and birth year.",
    "Six composers in JSON, with name, genre as field, and birth year.",
    "Name six explorers as JSON with name, region as field and year born.",
]


def prompts(engine: LLMEngine, n: int) -> list[list[int]]:
    tok = engine.tokenizer
    texts = [
        tok.apply_chat_template([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}])
        for i in range(n)
    ]
    return [tok.encode(t, add_special_tokens=False) for t in texts]


def tpot_ms(results: list[Completion]) -> tuple[float, int]:
    values, tokens = [], 0
    for r in results:
        tl = r.outputs[-1].timeline
        n = len(r.token_ids)
        tokens += n
        if n > 1 and tl.first_token is not None and tl.finished is not None:
            values.append((tl.finished - tl.first_token) / (n - 1) * 1000)
    return statistics.mean(values), tokens


def run(engine: LLMEngine, concurrency: int, max_tokens: int, grammar: str | None) -> tuple[float, int]:
    params = SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=grammar is None, grammar=grammar
    )
    return tpot_ms(engine.generate(prompts(engine, concurrency), params))


def compile_times(engine: LLMEngine) -> dict[str, float]:
    schemas = json.loads((ROOT / "tests" / "structured" / "schemas.json").read_text()) + [SCHEMA]
    tokenizer = engine.runner.grammar._tokenizer.get()
    to_grammar, to_matcher = [], []
    for schema in schemas:
        t0 = time.perf_counter()
        grammar = json_schema_grammar(schema)
        t1 = time.perf_counter()
        llguidance.LLMatcher(tokenizer, grammar)
        to_grammar.append((t1 - t0) * 1000)
        to_matcher.append((time.perf_counter() - t1) * 1000)
    return {
        "schemas": len(schemas),
        "grammar_median": statistics.median(to_grammar),
        "grammar_max": max(to_grammar),
        "matcher_median": statistics.median(to_matcher),
        "matcher_max": max(to_matcher),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--peer", action="store_true", help="also measure llama.cpp's llama-server (bench/peers.py)"
    )
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    engine = LLMEngine(EngineConfig(dtype="bfloat16", batch_window_ms=0, enable_prefix_caching=False))
    engine.runner.grammar._tokenizer.get()  # built on a thread since engine start
    t0 = time.perf_counter()
    llguidance.hf.from_tokenizer(engine.tokenizer.hf, n_vocab=engine.tokenizer.vocab_size)  # timed again
    vocab_ready = time.perf_counter() - t0
    compile_stats = compile_times(engine)
    grammar = json_schema_grammar(SCHEMA)
    run(engine, 2, 16, None)  # warm-up
    rows = []
    for c in args.concurrency:
        free, constrained = [], []
        for _ in range(args.repeats):
            free.append(run(engine, c, args.max_tokens, None))
            constrained.append(run(engine, c, args.max_tokens, grammar))
        rows.append((c, free, constrained))
    peer = []
    if args.peer:
        gguf = engine.checkpoint.gguf_path
        del engine  # the peer gets the cores to itself
        peer = peer_rows(gguf, QUESTIONS, SCHEMA, args.concurrency, args.max_tokens, args.repeats)
    table = render(rows, peer, compile_stats, vocab_ready, (load_before, os.getloadavg()[0]), args)
    print(table)
    if args.write_docs:
        replace_section(ROOT / "docs" / "benchmarks.md", "structured-outputs", table)


def render(rows, peer, compile_stats, vocab_ready, loads, args) -> str:
    lines = [
        "### Structured outputs: TPOT with a JSON schema vs unconstrained, Gemma 3 270M (bf16)",
        "",
        f"Machine: {machine()}; 1-min load average {loads[0]:.1f} before, {loads[1]:.1f} after (a shared "
        "2-core machine: other sessions were running). Command: `.venv/bin/python bench/structured.py "
        f"--concurrency {' '.join(map(str, args.concurrency))} --max-tokens {args.max_tokens} "
        f"--repeats {args.repeats} --threads {args.threads}{' --peer' if args.peer else ''} --write-docs`. "
        "Greedy; the schema is an array of "
        "six {name, field, born} objects; unconstrained requests ignore EOS. Each cell: mean TPOT of the "
        "run's requests, runs interleaved free / JSON. With `--peer`, llama-server serves the same GGUF in "
        "its own Q4_K_M kernels (ours dequantizes it to bf16) after our runs: compare the ratios, not the "
        f"absolute TPOTs. Measured {time.strftime('%Y-%m-%d')}.",
        "",
        "| system | concurrency | free TPOT ms | JSON TPOT ms | JSON / free (means) | median pair ratio |",
        "|---|---|---|---|---|---|",
    ]
    ours = [(c, [v for v, _ in f], [v for v, _ in j]) for c, f, j in rows]
    for system, table_rows in (("edgeinfer (bf16)", ours), ("llama.cpp llama-server (Q4_K_M, GBNF)", peer)):
        for c, free, constrained in table_rows:
            f_ms, j_ms = statistics.mean(free), statistics.mean(constrained)
            pairs = statistics.median(j / f for f, j in zip(free, constrained, strict=True))
            lines.append(f"| {system} | {c} | {f_ms:.1f} | {j_ms:.1f} | {j_ms / f_ms:.3f} | {pairs:.3f} |")
    s = compile_stats
    lines += [
        "",
        "Compile: llguidance's view of the 262,144-entry vocabulary takes "
        f"{vocab_ready:.1f} s to build, once per engine, on a background thread from engine start "
        "(constrained requests wait for it). Per schema "
        f"({s['schemas']} schemas): schema → grammar median {s['grammar_median']:.2f} ms (max "
        f"{s['grammar_max']:.2f}), grammar → matcher median {s['matcher_median']:.2f} ms (max "
        f"{s['matcher_max']:.2f}).",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()

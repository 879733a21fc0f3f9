"""`edgeinfer eval`: perplexity, KL divergence, top-1 agreement and greedy match length of a quantized
configuration against the unquantized baseline (the top-level CLI finds `eval_command` here)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

from edgeinfer.eval.harness import DEFAULT_TEXT, EvalSettings, run_eval


def _quantization(value: str) -> str | None:
    return None if value.lower() in ("none", "bf16", "") else value


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = EvalSettings()
    p.add_argument("--model", default=d.model, help="HF directory, .gguf or known name (%(default)s)")
    p.add_argument("--quantization", type=_quantization, default=None, help="int8, int4, int4:G, fp8 or none")
    p.add_argument("--kv-cache-dtype", default="auto", help="auto, bf16, int8, fp8_e4m3, fp8_e5m2, int4")
    p.add_argument(
        "--baseline-quantization",
        type=_quantization,
        default=None,
        help="weights of the reference (default none: the checkpoint dequantized to --dtype)",
    )
    p.add_argument(
        "--lm-head-quantization",
        default="auto",
        help="lm_head and embeddings under weight quantization: auto (int8 for int4 weights, else the "
        "same method), none (float), or a method",
    )
    p.add_argument(
        "--calibrate",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="activation-aware input scaling before quantizing (default yes)",
    )
    p.add_argument(
        "--gptq",
        default=None,
        metavar="TEXT",
        help="round int4 weights by GPTQ calibrated on TEXT: enwiki (Wikipedia prose in gensim's test "
        "data) or a UTF-8 file (default: round to nearest)",
    )
    p.add_argument(
        "--cpu-gemv",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="quantized side through our CPU kernels (int4 as W4A8), as `serve` runs it; default: where "
        "the CPU has AVX512-VNNI (the baseline never uses them)",
    )
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="compute dtype")
    p.add_argument(
        "--text",
        default=DEFAULT_TEXT,
        help=f"eval text: {DEFAULT_TEXT!r} (news corpus shipped in gensim's test data) or a UTF-8 file",
    )
    p.add_argument("--tokens", type=int, default=d.tokens, help="tokens of the text to score (%(default)s)")
    p.add_argument("--window", type=int, default=d.window, help="tokens per scoring window (%(default)s)")
    p.add_argument("--stride", type=int, default=None, help="tokens between windows (default window/2)")
    p.add_argument("--prefixes", type=int, default=d.prefixes, help="greedy-match prompts (%(default)s)")
    p.add_argument(
        "--prefix-tokens", type=int, default=d.prefix_tokens, help="tokens per prompt (%(default)s)"
    )
    p.add_argument(
        "--greedy-tokens", type=int, default=d.greedy_tokens, help="tokens generated (%(default)s)"
    )
    p.add_argument(
        "--json",
        type=Path,
        default=None,
        metavar="PATH",
        help="also write the report as JSON ('-': to stdout, the table then to stderr)",
    )


def run(args: argparse.Namespace) -> int:
    settings = EvalSettings(
        model=args.model,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        baseline_quantization=args.baseline_quantization,
        lm_head_quantization=args.lm_head_quantization,
        calibrate=args.calibrate,
        gptq=args.gptq,
        cpu_gemv=args.cpu_gemv,
        dtype=args.dtype,
        text=args.text,
        tokens=args.tokens,
        window=args.window,
        stride=args.stride,
        prefixes=args.prefixes,
        prefix_tokens=args.prefix_tokens,
        greedy_tokens=args.greedy_tokens,
    )
    report = run_eval(settings)
    to_stdout = args.json is not None and str(args.json) == "-"
    # With `--json -` stdout carries only the JSON (for pipes); the table goes to stderr.
    print(report.table(), file=sys.stderr if to_stdout else sys.stdout)
    if args.json is not None:
        payload = json.dumps(report.to_dict(), indent=2) + "\n"
        if to_stdout:
            sys.stdout.write(payload)
        else:
            args.json.write_text(payload)
    return 0


eval_command = SimpleNamespace(add_arguments=add_arguments, run=run)

"""`edgeinfer eval`: perplexity, KL divergence, top-1 agreement and greedy match length of a quantized
configuration against the unquantized baseline (the top-level CLI finds `eval_command` here)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

from edgeinfer.cli.engine_args import (
    add_engine_arguments,
    add_model_argument,
    engine_config,
    quantization_arg,
    start_runtime_for,
)
from edgeinfer.eval.harness import EvalSettings, run_eval


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = EvalSettings()
    add_model_argument(p)
    add_engine_arguments(p.add_argument_group("engine (the tested side; the baseline as noted)"))
    p.add_argument(
        "--baseline-quantization",
        type=quantization_arg,
        default=d.baseline_quantization,
        help="weights of the reference (default none: the checkpoint dequantized to --dtype); the reference "
        "keeps its KV cache in the compute dtype and runs on torch's kernels",
    )
    p.add_argument(
        "--text",
        default=d.text,
        help=f"eval text: {d.text!r} (news corpus shipped in gensim's test data) or a UTF-8 file",
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


def settings(args: argparse.Namespace) -> EvalSettings:
    return EvalSettings(
        engine=engine_config(args, args.model),
        baseline_quantization=args.baseline_quantization,
        text=args.text,
        tokens=args.tokens,
        window=args.window,
        stride=args.stride,
        prefixes=args.prefixes,
        prefix_tokens=args.prefix_tokens,
        greedy_tokens=args.greedy_tokens,
    )


def run(args: argparse.Namespace) -> int:
    eval_settings = settings(args)
    start_runtime_for(args)
    report = run_eval(eval_settings)
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

"""`edgeinfer generate`: one prompt in, the completion text out on stdout (and nothing else)."""

from __future__ import annotations

import argparse
import sys
import uuid

from edgeinfer.engine.config import DEFAULT_MODEL, EngineConfig
from edgeinfer.types import EngineRequest, SamplingParams


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="HF directory, .gguf file or a known name "
        f"(default: {DEFAULT_MODEL}, obtained and cached on first use)",
    )
    p.add_argument("--prompt", required=True, help="the prompt text (with --chat: the user message)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat format")
    p.add_argument("--system", default=None, help="system message (with --chat)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--quantization", default=None, help="weight quantization: int8, int4, fp8")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--threads", type=int, default=None, help="threads for the ops (default: every core)")
    p.add_argument(
        "--cpu-gemv",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="int8/int4/bf16 through our CPU kernels (int4 as W4A8; docs/quantization.md); default: where "
        "the CPU has the features (AVX512-VNNI for int8/int4, AVX2 for bf16)",
    )


def run(args: argparse.Namespace) -> int:
    # Validate before the (slow) model load so mistakes fail fast.
    sampling = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
    )
    from edgeinfer.engine.engine import LLMEngine

    engine = LLMEngine(
        EngineConfig(
            model=args.model,
            dtype=args.dtype,
            quantization=args.quantization,
            kv_cache_dtype=args.kv_cache_dtype,
            cpu_gemv=args.cpu_gemv,
            batch_window_ms=0,
            threads=args.threads,
        )
    )
    prompt = args.prompt
    if args.chat:
        messages = [{"role": "system", "content": args.system}] if args.system else []
        prompt = engine.tokenizer.apply_chat_template(messages + [{"role": "user", "content": prompt}])
    ids = engine.tokenizer.encode(prompt, add_special_tokens=not args.chat)
    engine.add_request(EngineRequest(f"cli-{uuid.uuid4().hex[:8]}", ids, sampling))
    while engine.has_unfinished_requests():
        for out in engine.step():
            sys.stdout.write(out.text_delta)
            sys.stdout.flush()
    sys.stdout.write("\n")
    return 0

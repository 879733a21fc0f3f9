"""`edgeinfer generate`: one prompt in, the completion text out on stdout (and nothing else)."""

from __future__ import annotations

import argparse
import sys
import uuid

from edgeinfer.cli.engine_args import (
    add_engine_arguments,
    add_model_argument,
    engine_config,
    start_runtime_for,
)
from edgeinfer.types import EngineRequest, SamplingParams


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_argument(p)
    p.add_argument("--prompt", required=True, help="the prompt text (with --chat: the user message)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat format")
    p.add_argument("--system", default=None, help="system message (with --chat)")
    add_engine_arguments(p.add_argument_group("engine"))


def run(args: argparse.Namespace) -> int:
    # Validate before the (slow) model load so mistakes fail fast.
    sampling = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
    )
    config = engine_config(args, args.model)
    start_runtime_for(args)
    from edgeinfer.engine.engine import LLMEngine

    engine = LLMEngine(config)
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

"""`edgeinfer bench serve`: load-test any OpenAI-compatible server and report serving metrics.

    edgeinfer bench serve --base-url http://127.0.0.1:8000 --dataset random \\
        --random-input-len 128 --random-output-len 64:256 --num-prompts 200 --request-rate 4 \\
        --max-concurrency 32 --slo-ttft-ms 500 --slo-tpot-ms 100 --output-json results.json
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
from pathlib import Path

import httpx
from tqdm import tqdm

from edgeinfer.bench.client import ENDPOINTS
from edgeinfer.bench.datasets import (
    Session,
    multi_turn_dataset,
    parse_range,
    random_dataset,
    shared_prefix_dataset,
)
from edgeinfer.bench.metrics import SLO
from edgeinfer.bench.report import format_table, result_json, write_json
from edgeinfer.bench.runner import BenchConfig, run_benchmark

DATASETS = ("random", "shared-prefix", "multi-turn")


def _rate(text: str) -> float:
    value = float(text)  # float() accepts "inf"
    if not value > 0:
        raise argparse.ArgumentTypeError(f"request rate must be > 0 or inf, got {text!r}")
    return value


def _length(text: str) -> tuple[int, int]:
    try:
        return parse_range(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the `bench` subcommands (currently `serve`) to `parser`."""
    sub = parser.add_subparsers(dest="bench_command", required=True, metavar="{serve}")
    serve = sub.add_parser("serve", help="load-test an OpenAI-compatible server", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    _add_serve_arguments(serve)


def _add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", required=True, help="server root, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model name to send (default: the first of GET /v1/models)")
    p.add_argument("--endpoint", choices=ENDPOINTS, default="/v1/completions")
    p.add_argument("--api-key", default=os.environ.get("EDGEINFER_API_KEY"),
                   help="bearer token (default: $EDGEINFER_API_KEY)")  # fmt: skip
    p.add_argument("--dataset", choices=DATASETS, default="random")
    p.add_argument("--num-prompts", type=int, default=100, help="requests in total (multi-turn: all turns)")
    p.add_argument("--request-rate", type=_rate, default=math.inf,
                   help="sessions per second, Poisson arrivals; inf sends all at once (default)")  # fmt: skip
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrival gaps; 1 = Poisson")
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--random-input-len", type=_length, default=(128, 128), help="tokens: N or LO:HI")
    p.add_argument("--random-output-len", type=_length, default=(128, 128), help="tokens: N or LO:HI")
    p.add_argument("--shared-prefix-groups", type=int, default=4)
    p.add_argument("--shared-prefix-len", type=int, default=512, help="tokens of the shared prefix")
    p.add_argument("--multi-turn-turns", type=int, default=4, help="turns per session")
    p.add_argument("--slo-ttft-ms", type=float, default=None)
    p.add_argument("--slo-tpot-ms", type=float, default=None)
    p.add_argument("--num-warmups", type=int, default=1, help="unrecorded requests sent first")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--output-json", type=Path, default=None)
    p.add_argument("--save-detailed", action="store_true", help="also write per-request timings to the JSON")
    p.add_argument("--no-progress", action="store_true")


def build_sessions(args: argparse.Namespace) -> list[Session]:
    """The workload the arguments describe (deterministic for a given --seed)."""
    if args.dataset == "random":
        return random_dataset(args.num_prompts, args.random_input_len, args.random_output_len, args.seed)
    if args.dataset == "shared-prefix":
        return shared_prefix_dataset(args.num_prompts, args.shared_prefix_groups, args.shared_prefix_len,
                                     args.random_input_len, args.random_output_len, args.seed)  # fmt: skip
    return multi_turn_dataset(
        args.num_prompts, args.multi_turn_turns, args.random_input_len, args.random_output_len, args.seed
    )


def discover_model(base_url: str, api_key: str | None) -> str:
    """The id of the first model that GET /v1/models lists; ValueError if there is none."""
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=10.0)
        response.raise_for_status()
        models = response.json().get("data") or []
    except (httpx.HTTPError, ValueError) as exc:
        raise ValueError(f"could not list models at {base_url}/v1/models ({exc}); pass --model") from None
    if not models:
        raise ValueError(f"{base_url}/v1/models lists no models; pass --model")
    return str(models[0]["id"])


def config_from_args(args: argparse.Namespace, model: str) -> BenchConfig:
    """The BenchConfig for parsed `bench serve` arguments."""
    return BenchConfig(
        base_url=args.base_url,
        model=model,
        endpoint=args.endpoint,
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        num_warmups=args.num_warmups,
        seed=args.seed,
        api_key=args.api_key,
        slo=SLO(ttft_ms=args.slo_ttft_ms, tpot_ms=args.slo_tpot_ms),
        request_timeout_s=args.request_timeout,
    )


def run(args: argparse.Namespace) -> int:
    """Run `edgeinfer bench serve`; 0 if at least one request succeeded, 1 if none did, 2 on bad arguments."""
    try:
        model = args.model or discover_model(args.base_url, args.api_key)
        config = config_from_args(args, model)
        sessions = build_sessions(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    total = sum(len(s.turns) for s in sessions)
    with tqdm(total=total, disable=args.no_progress, file=sys.stderr, unit="req") as bar:
        result = asyncio.run(run_benchmark(config, sessions, progress=lambda: bar.update(1)))
    print(format_table(result.summary))
    if args.output_json:
        extra = {"dataset": args.dataset, "num_prompts": args.num_prompts}
        write_json(args.output_json, result_json(result, config, extra, detailed=args.save_detailed))
        print(f"wrote {args.output_json}", file=sys.stderr)
    return 0 if result.summary.completed else 1

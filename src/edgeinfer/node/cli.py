"""`edgeinfer serve`: the node server (OpenAI and Workers-AI APIs) over a warm model pool."""

from __future__ import annotations

import argparse
import logging
import socket
import sys
from pathlib import Path

from edgeinfer.cli.engine_args import add_engine_arguments, engine_config
from edgeinfer.engine.config import DEFAULT_EMBEDDING_MODEL, DEFAULT_MODEL
from edgeinfer.node.config import ConnectionLimits, NodeConfig, NodeLimits, default_usage_db
from edgeinfer.obs.access_log import ACCESS_LOGGER
from edgeinfer.pool.spec import (
    LOCAL,
    UPSTREAM,
    MemberSpec,
    parse_alias_arg,
    parse_bytes,
    parse_model_arg,
    parse_public_prefixes,
    parse_upstream_arg,
    parse_upstream_tokenizer_arg,
)
from edgeinfer.types.router_trust import load_secret

DEFAULT_ALIASES = ("@cf/google/gemma-3-270m",)
DEFAULT_EMBEDDING_ALIASES = ("@cf/sentence-transformers/all-minilm-l6-v2",)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    models = parser.add_argument_group("models and pool")
    models.add_argument(
        "--model",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help=f"register a local model (repeatable; names may contain '/'); default {DEFAULT_MODEL} and "
        f"the embedding model {DEFAULT_EMBEDDING_MODEL}",
    )
    models.add_argument(
        "--upstream",
        action="append",
        default=[],
        metavar="NAME=URL",
        help="register an external OpenAI-compatible server (SGLang, vLLM, llama.cpp, edgeinfer)",
    )
    models.add_argument(
        "--upstream-tokenizer",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="count an upstream's prompt tokens (for rate limits) with this checkpoint's tokenizer",
    )
    models.add_argument(
        "--alias", action="append", default=[], metavar="ALIAS=NAME", help="another name for a model"
    )
    models.add_argument(
        "--preload",
        nargs="*",
        default=None,
        metavar="NAME",
        help="load these models at start (bare --preload: every local model)",
    )
    models.add_argument("--pin", action="append", default=[], metavar="NAME", help="never evict this model")
    models.add_argument(
        "--memory-budget",
        default=None,
        metavar="SIZE",
        help="memory for resident models, e.g. 2GiB (default: unlimited)",
    )
    engine = parser.add_argument_group("engine (for every local model)")
    add_engine_arguments(engine)
    engine.add_argument(
        "--public-prefixes",
        default=None,
        metavar="FILE",
        help="shared prefixes per model, computed at load and hit by every tenant (JSON/TOML: "
        '{"MODEL": {"texts": [...], "system_prompts": [...]}}; docs/engine.md)',
    )
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1")
    server.add_argument("--port", type=int, default=8000)
    server.add_argument(
        "--tenants",
        default=None,
        metavar="FILE",
        help="API keys (JSON/TOML, sha256 only); without it the server runs open",
    )
    server.add_argument("--prices", default=None, metavar="FILE", help="per-model price table (JSON/TOML)")
    server.add_argument(
        "--usage-db", default=None, metavar="PATH", help=f"SQLite usage store ({default_usage_db()})"
    )
    server.add_argument(
        "--secret-file",
        default=None,
        metavar="FILE",
        help="key for tenant cache namespaces (default: random per process)",
    )
    server.add_argument("--no-access-log", action="store_true")
    server.add_argument(
        "--trusted-proxy",
        action="append",
        default=[],
        metavar="ADDR",
        help="an address (or CIDR) whose X-Forwarded-For is believed, e.g. the router's (repeatable; "
        "default: nobody's); trusted proxies are also exempt from --max-connections-per-client",
    )
    server.add_argument(
        "--usage-checkpoint-interval",
        type=float,
        default=NodeConfig.usage_checkpoint_s,
        metavar="S",
        help="save the usage of requests in flight this often; a crash loses at most this much "
        f"({NodeConfig.usage_checkpoint_s:g})",
    )
    server.add_argument(
        "--switch-interval-ms",
        type=float,
        default=NodeConfig.switch_interval_s * 1000,
        metavar="MS",
        help="the interpreter's GIL switch interval: how long the engines' step threads may wait for the "
        f"GIL while the event loop holds it ({NodeConfig.switch_interval_s * 1000:g}; Python's default 5)",
    )
    connections = parser.add_argument_group("slow or stalled clients (seconds; connections)")
    for name, text in _CONNECTION_HELP.items():
        value = getattr(ConnectionLimits(), name)
        flag = "--" + name.removesuffix("_s").replace("_", "-")
        kind = int if isinstance(value, int) else float
        connections.add_argument(
            flag,
            dest=name,
            type=kind,
            default=value,
            metavar=kind.__name__.upper(),
            help=f"{text} ({value:g})",
        )
    fleet = parser.add_argument_group("fleet (behind `edgeinfer router`; see docs/router.md)")
    fleet.add_argument("--node-id", default=None, help="this node's id in the fleet file (HOSTNAME-PORT)")
    fleet.add_argument("--location", default="", help="the location code this node is in (FRA, AMS, ...)")
    fleet.add_argument(
        "--nats-url", default=None, metavar="URL", help="publish this node's status on NATS (nats://...)"
    )
    fleet.add_argument(
        "--status-interval-ms", type=float, default=100.0, help="how often the status is published (100)"
    )
    fleet.add_argument(
        "--router-secret-file",
        default=None,
        metavar="FILE",
        help="secret shared with the routers: trust the tenant they sign into x-edgeinfer-tenant",
    )
    limits = parser.add_argument_group(
        "request limits (beyond them: 400, 413 for the body, 429 for the queue)"
    )
    defaults = NodeLimits()
    for name, text in _LIMIT_HELP.items():
        value = getattr(defaults, name)
        limits.add_argument(f"--{name.replace('_', '-')}", type=int, default=value, help=f"{text} ({value})")


_LIMIT_HELP = {
    "max_prompt_tokens": "prompt tokens per request",
    "max_tokens": "max_tokens per request",
    "max_n": "choices per request (n × prompts)",
    "max_top_logprobs": "top logprobs per token",
    "max_stop": "stop sequences per request",
    "ttft_bucket_ms": "hold every first token to a multiple of this many ms (hides cache hits); 0: off",
    "max_body_bytes": "request body bytes",
    "max_queue_depth": "requests waiting per model before 429 (code 3040)",
    "workers_ai_default_max_tokens": "max_tokens when a Workers-AI request gives none",
    "max_embedding_inputs": "inputs per embeddings request",
}


_CONNECTION_HELP = {
    "header_timeout_s": "a connection must complete its request headers within this; else it is closed",
    "body_timeout_s": "a request body must arrive within this after its headers; else 408",
    "keep_alive_timeout_s": "an idle keep-alive connection is closed after this",
    "max_connections_per_client": "connections one client address may hold open",
    "stream_write_timeout_s": "a stream whose reader takes nothing for this long is aborted",
    "shutdown_grace_s": "on SIGTERM, requests in flight may finish within this; the rest are aborted",
}


def build_config(args: argparse.Namespace) -> NodeConfig:
    limits = NodeLimits(**{name: getattr(args, name) for name in NodeLimits.__dataclass_fields__})
    connections = ConnectionLimits(
        **{name: getattr(args, name) for name in ConnectionLimits.__dataclass_fields__}
    )
    return NodeConfig(
        limits=limits,
        connections=connections,
        trusted_proxies=tuple(args.trusted_proxy),
        usage_checkpoint_s=args.usage_checkpoint_interval,
        tenants_file=args.tenants,
        prices_file=args.prices,
        usage_db=args.usage_db or default_usage_db(),
        server_secret=Path(args.secret_file).read_bytes() if args.secret_file else None,
        preload=tuple(_preload_names(args)),
        node_id=args.node_id or f"{socket.gethostname()}-{args.port}",
        location=args.location,
        nats_url=args.nats_url,
        status_interval_s=args.status_interval_ms / 1000.0,
        router_secret=load_secret(args.router_secret_file) if args.router_secret_file else None,
        switch_interval_s=args.switch_interval_ms / 1000.0,
    )


def build_specs(args: argparse.Namespace) -> list[MemberSpec]:
    specs = [parse_model_arg(v) for v in args.model] + [parse_upstream_arg(v) for v in args.upstream]
    if not specs:
        specs = [
            MemberSpec(DEFAULT_MODEL, LOCAL, DEFAULT_MODEL),
            MemberSpec(DEFAULT_EMBEDDING_MODEL, LOCAL, DEFAULT_EMBEDDING_MODEL),
        ]
    aliases: dict[str, list[str]] = {}
    for value in args.alias:
        alias, name = parse_alias_arg(value)
        aliases.setdefault(name, []).append(alias)
    defaults = {DEFAULT_MODEL: DEFAULT_ALIASES, DEFAULT_EMBEDDING_MODEL: DEFAULT_EMBEDDING_ALIASES}
    for name, default_aliases in defaults.items():
        aliases.setdefault(name, []).extend(default_aliases)
    tokenizers = dict(parse_upstream_tokenizer_arg(v) for v in args.upstream_tokenizer)
    names = {s.name for s in specs}
    unknown = (set(args.pin) | {n for n in aliases if n not in defaults}) - names
    if unknown:
        raise ValueError(f"--pin/--alias name unknown model(s): {', '.join(sorted(unknown))}")
    if bad := set(tokenizers) - {s.name for s in specs if s.kind == UPSTREAM}:
        raise ValueError(f"--upstream-tokenizer names no upstream: {', '.join(sorted(bad))}")
    return [
        MemberSpec(
            s.name,
            s.kind,
            s.target,
            tuple(a for a in aliases.get(s.name, ()) if a != s.name),
            s.name in args.pin,
            tokenizers.get(s.name),
        )
        for s in specs
    ]


def _preload_names(args: argparse.Namespace) -> list[str]:
    if args.preload is None:
        return []
    if args.preload:
        return list(args.preload)
    specs = build_specs(args)
    return [s.name for s in specs if s.kind == LOCAL]


def run(args: argparse.Namespace) -> int:
    """Start the server and block until it stops (Ctrl-C)."""
    from edgeinfer.node.app import create_app
    from edgeinfer.node.files import load_table
    from edgeinfer.node.server import NodeServer, configure_process, uvicorn_config
    from edgeinfer.pool.loader import EngineLoader
    from edgeinfer.pool.manager import ModelPool

    config = build_config(args)
    specs = build_specs(args)
    _check_local_models(specs, args.quantization)
    budget = parse_bytes(args.memory_budget) if args.memory_budget else None
    public = parse_public_prefixes(load_table(args.public_prefixes)) if args.public_prefixes else {}
    pool = ModelPool(specs, EngineLoader(engine_config(args), public_prefixes=public), budget_bytes=budget)
    for name in config.preload:
        pool.resolve(name)  # an unknown --preload name fails here, in one line, before anything loads
    _configure_access_log(enabled=not args.no_access_log)
    configure_process(config)
    app = create_app(config, pool)
    NodeServer(uvicorn_config(app, config, args.host, args.port)).run()
    return 0


def _check_local_models(specs: list[MemberSpec], quantization: str | None) -> None:
    """What a first request would find wrong, found before the server listens: a local model that is not
    there and a weight method that does not exist are one-line errors at start, not a 500 per request."""
    from edgeinfer.engine.loading import parse_quantization
    from edgeinfer.engine.model.loader.opener import checkpoint_location

    if quantization:
        parse_quantization(quantization)
    for spec in specs:
        if spec.kind == LOCAL and not checkpoint_location(spec.target).exists():
            raise ValueError(f"--model {spec.name}: {spec.target}: no such file or directory")


def _configure_access_log(enabled: bool) -> None:
    """Access lines are bare JSON on stdout (one per request); everything else logs to stderr."""
    access = logging.getLogger(ACCESS_LOGGER)
    access.propagate = False
    access.setLevel(logging.INFO if enabled else logging.WARNING)
    if enabled and not access.handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(message)s"))
        access.addHandler(handler)


def main(argv: list[str] | None = None) -> int:
    """`python -m edgeinfer.node ...`: the same as `edgeinfer serve ...`."""
    parser = argparse.ArgumentParser(prog="edgeinfer serve", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return run(args)
    except (ValueError, OSError) as exc:
        print(f"edgeinfer serve: error: {exc}", file=sys.stderr)
        return 2

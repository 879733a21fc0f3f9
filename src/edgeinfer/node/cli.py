"""`edgeinfer serve`: the node server (OpenAI and Workers-AI APIs) over a warm model pool."""

from __future__ import annotations

import argparse
import gc
import logging
import socket
import sys
from pathlib import Path

from edgeinfer.api.limits import NodeLimits
from edgeinfer.api.router_trust import load_secret
from edgeinfer.batch.flags import batch_settings
from edgeinfer.cli.engine_args import engine_config, start_runtime_for
from edgeinfer.engine.config import DEFAULT_EMBEDDING_MODEL, DEFAULT_MODEL
from edgeinfer.node.cli_flags import add_arguments
from edgeinfer.node.config import ConnectionLimits, NodeConfig, default_finetunes_dir, default_usage_db
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

DEFAULT_ALIASES = ("@cf/google/gemma-3-270m",)
DEFAULT_EMBEDDING_ALIASES = ("@cf/sentence-transformers/all-minilm-l6-v2",)

__all__ = ["add_arguments", "build_config", "build_specs", "main", "run"]


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
        finetunes_dir=args.finetunes_dir or default_finetunes_dir(),
        server_secret=Path(args.secret_file).read_bytes() if args.secret_file else None,
        preload=tuple(_preload_names(args)),
        node_id=args.node_id or f"{socket.gethostname()}-{args.port}",
        location=args.location,
        nats_url=args.nats_url,
        status_interval_s=args.status_interval_ms / 1000.0,
        batch=batch_settings(args),
        batch_slots=args.batch_slots,
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
    from edgeinfer.api.files import load_table
    from edgeinfer.node.http.app import create_app
    from edgeinfer.node.http.server import NodeServer, configure_process, uvicorn_config
    from edgeinfer.pool.loader import EngineLoader
    from edgeinfer.pool.manager import ModelPool

    config = build_config(args)
    specs = build_specs(args)
    budget = parse_bytes(args.memory_budget) if args.memory_budget else None
    _check_local_models(specs, args.quantization)
    start_runtime_for(args)
    public = parse_public_prefixes(load_table(args.public_prefixes)) if args.public_prefixes else {}
    pool = ModelPool(specs, EngineLoader(engine_config(args), public_prefixes=public), budget_bytes=budget)
    for name in config.preload:
        pool.resolve(name)  # an unknown --preload name fails here, in one line, before anything loads
    _configure_access_log(enabled=not args.no_access_log)
    # The modules imported so far, most of the heap at start, live as long as the process: out of the
    # collector's sight, the collections that loading a model triggers do not walk them all again.
    gc.freeze()
    configure_process(config)
    app = create_app(config, pool)
    NodeServer(uvicorn_config(app, config, args.host, args.port)).run()
    return 0


def _check_local_models(specs: list[MemberSpec], quantization: str | None) -> None:
    """What a first request would find wrong, found before the server listens: a local model that is not
    there and a weight method that does not exist are one-line errors at start, not a 500 per request."""
    from edgeinfer.engine.loading import parse_quantization
    from edgeinfer.engine.model.loader.opener import is_known_model

    if quantization:
        parse_quantization(quantization)
    # a default model's name needs its packages, checked (and the file assembled) when it first loads
    paths = [s for s in specs if s.kind == LOCAL and not is_known_model(s.target)]
    for spec in paths:
        if not Path(spec.target).expanduser().exists():
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

"""The flags of `edgeinfer serve`, by help group; `cli.build_config` reads them into a `NodeConfig`."""

from __future__ import annotations

import argparse

from edgeinfer.api.limits import NodeLimits
from edgeinfer.batch.flags import add_batch_flags
from edgeinfer.cli.engine_args import add_engine_arguments
from edgeinfer.engine.config import DEFAULT_EMBEDDING_MODEL, DEFAULT_MODEL
from edgeinfer.node.config import ConnectionLimits, NodeConfig, default_finetunes_dir, default_usage_db


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Every flag of `edgeinfer serve`, in its help group."""
    _model_flags(parser.add_argument_group("models and pool"))
    engine = parser.add_argument_group("engine (for every local model)")
    add_engine_arguments(engine)
    _engine_flags(engine)
    _server_flags(parser.add_argument_group("server"))
    _connection_flags(parser.add_argument_group("slow or stalled clients (seconds; connections)"))
    _fleet_flags(parser.add_argument_group("fleet (behind `edgeinfer router`; see docs/router.md)"))
    _limit_flags(
        parser.add_argument_group("request limits (beyond them: 400, 413 for the body, 429 for the queue)")
    )


def _model_flags(models: argparse._ArgumentGroup) -> None:
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


def _engine_flags(engine: argparse._ArgumentGroup) -> None:
    engine.add_argument(
        "--public-prefixes",
        default=None,
        metavar="FILE",
        help="shared prefixes per model, computed at load and hit by every tenant (JSON/TOML: "
        '{"MODEL": {"texts": [...], "system_prompts": [...]}}; docs/engine.md)',
    )


def _server_flags(server: argparse._ArgumentGroup) -> None:
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
        "--finetunes-dir",
        default=None,
        metavar="DIR",
        help=f"uploaded LoRA finetunes off NATS ({default_finetunes_dir()}); on NATS the fleet keeps them",
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


def _connection_flags(connections: argparse._ArgumentGroup) -> None:
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


def _limit_flags(limits: argparse._ArgumentGroup) -> None:
    defaults = NodeLimits()
    for name, text in _LIMIT_HELP.items():
        value = getattr(defaults, name)
        limits.add_argument(f"--{name.replace('_', '-')}", type=int, default=value, help=f"{text} ({value})")


def _fleet_flags(fleet: argparse._ArgumentGroup) -> None:
    fleet.add_argument("--node-id", default=None, help="this node's id in the fleet file (HOSTNAME-PORT)")
    fleet.add_argument("--location", default="", help="the location code this node is in (FRA, AMS, ...)")
    fleet.add_argument(
        "--nats-url",
        default=None,
        metavar="URL",
        help="publish this node's status and its usage events (for `edgeinfer ledger`) on NATS (nats://...), "
        "and take queued requests (the Batch API) from its JetStream",
    )
    fleet.add_argument(
        "--status-interval-ms", type=float, default=100.0, help="how often the status is published (100)"
    )
    fleet.add_argument(
        "--batch-slots",
        type=int,
        default=None,
        metavar="N",
        help="queued entries (the Batch API, with --nats-url) of one model this node runs at once "
        "(default: one per engine seat, when no interactive request waits; 0: run none)",
    )
    add_batch_flags(fleet)
    fleet.add_argument(
        "--router-secret-file",
        default=None,
        metavar="FILE",
        help="secret shared with the routers: trust the tenant they sign into x-edgeinfer-tenant",
    )


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

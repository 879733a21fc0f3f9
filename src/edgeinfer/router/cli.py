"""`edgeinfer router`: the edge router in front of a fleet of nodes (docs/router.md)."""

from __future__ import annotations

import argparse
import logging

from edgeinfer.api.router_trust import load_secret
from edgeinfer.batch.flags import add_batch_flags, batch_settings
from edgeinfer.router.config import RouterConfig
from edgeinfer.router.limits.limiter import FleetLimitsConfig
from edgeinfer.router.policy import PolicyConfig, Strategy

_POLICY_HELP = {
    "stale_after_s": "status older than this counts as saturated",
    "drop_after_s": "a node silent this long drops out",
    "busy_queue_depth": "queued requests at which a node is busy",
    "busy_kv_usage": "KV-cache usage at which a node is busy",
    "cold_load_s": "expected seconds to load a model that is not warm",
    "service_time_s": "mean seconds a request holds a slot (queue-wait estimate)",
    "prefill_tokens_per_s": "prefill speed for the uncached prompt estimate",
    "wait_per_running_s": "queue wait each running request adds to a newcomer's first token",
    "wait_per_queued_s": "queue wait each queued request adds to a newcomer's first token",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--fleet", required=True, metavar="FILE", help="fleet file (TOML): locations, nodes, RTTs"
    )
    parser.add_argument("--location", required=True, help="this router's location code (one of the fleet's)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        metavar="N",
        help="router processes sharing the port (SO_REUSEPORT), each with its own fleet state (1)",
    )
    parser.add_argument(
        "--nats-url",
        default=None,
        metavar="URL",
        help="fleet state, tenants' fleet limits and the Batch API's queue on NATS (else: poll each "
        "node's /node/status; no fleet limits, no queue)",
    )
    parser.add_argument("--tenants", default=None, metavar="FILE", help="the nodes' tenants file (else open)")
    parser.add_argument(
        "--router-secret-file",
        default=None,
        metavar="FILE",
        help="sign the tenant header for the nodes with it",
    )
    parser.add_argument(
        "--strategy",
        type=Strategy,
        default=Strategy.TTFT,
        choices=list(Strategy),
        help="ranking (baselines for benchmarks)",
    )
    parser.add_argument(
        "--emulate-rtt",
        action="store_true",
        help="tests and demos: delay each forward and answer by the one-way latency between locations",
    )
    parser.add_argument("--max-attempts", type=int, default=3, help="nodes tried before the first byte")
    parser.add_argument("--first-byte-timeout", type=float, default=120.0, metavar="S")
    parser.add_argument("--seed", type=int, default=None, help="seed the policy's random choices")
    parser.add_argument(
        "--limits-window-s",
        type=float,
        default=FleetLimitsConfig.window_s,
        metavar="S",
        help="the fleet limits' window: requests_per_minute and tokens_per_minute count per this many "
        "seconds (%(default)g: per minute; shorter for tests)",
    )
    add_batch_flags(parser.add_argument_group("the Batch API's queue (with --nats-url)"))
    policy = parser.add_argument_group("policy constants (docs/router.md)")
    defaults = PolicyConfig()
    for name, text in _POLICY_HELP.items():
        value = getattr(defaults, name)
        kind = type(value)
        policy.add_argument(f"--{name.replace('_', '-')}", type=kind, default=value, help=f"{text} ({value})")


def build_config(args: argparse.Namespace) -> RouterConfig:
    policy = PolicyConfig(**{name: getattr(args, name) for name in _POLICY_HELP})
    return RouterConfig(
        location=args.location.upper(),
        tenants_file=args.tenants,
        router_secret=load_secret(args.router_secret_file) if args.router_secret_file else None,
        nats_url=args.nats_url,
        batch=batch_settings(args),
        strategy=args.strategy,
        policy=policy,
        emulate_rtt=args.emulate_rtt,
        max_attempts=args.max_attempts,
        first_byte_timeout_s=args.first_byte_timeout,
        seed=args.seed,
        fleet_limits=FleetLimitsConfig(window_s=args.limits_window_s),
    )


def run(args: argparse.Namespace) -> int:
    from edgeinfer.router import server
    from edgeinfer.router.fleet_file import load_fleet

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per status poll otherwise
    return server.run(build_config(args), load_fleet(args.fleet), args.host, args.port, args.workers)

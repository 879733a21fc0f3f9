"""`edgeinfer fleet up`: a loopback fleet (NATS, a node and a router per location) for demos and tests."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path


def add_arguments(up: argparse.ArgumentParser) -> None:
    up.add_argument("--locations", type=int, default=3, metavar="N", help="how many locations (3)")
    up.add_argument(
        "--model",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="model for every node (repeatable; default: the node's default model)",
    )
    up.add_argument(
        "--memory-budget", default=None, metavar="SIZE[,SIZE...]", help="per node, or one per location"
    )
    up.add_argument(
        "--emulate-rtt", action="store_true", help="routers delay forwards by the inter-location latency"
    )
    up.add_argument(
        "--workdir", default=None, help="fleet file, secret and logs (default: a temporary directory)"
    )
    up.add_argument(
        "--node-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument for every node (repeatable)",
    )


def run(args: argparse.Namespace) -> int:
    from edgeinfer.fleet.up import run_fleet

    node_args = [a for m in args.model for a in ("--model", m)] + list(args.node_arg)
    if args.workdir:
        workdir = Path(args.workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        return run_fleet(args.locations, node_args, args.memory_budget, args.emulate_rtt, workdir)
    with tempfile.TemporaryDirectory(prefix="edgeinfer-fleet-") as tmp:
        return run_fleet(args.locations, node_args, args.memory_budget, args.emulate_rtt, Path(tmp))

"""`edgeinfer fleet`: SUBCOMMAND. Each subcommand lives in its own module (`up`: up_cli.py, `simulate`:
sim_cli.py)."""

from __future__ import annotations

import argparse
import importlib

# subcommand -> (module with add_arguments(parser) and run(args) -> int, help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "up": (
        "edgeinfer.fleet.up_cli",
        "start NATS, a node and a router per location on loopback; Ctrl-C stops all",
    ),
    "simulate": ("edgeinfer.fleet.sim_cli", "discrete-event simulation of a fleet under each routing policy"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="fleet_command", required=True, metavar="SUBCOMMAND")
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        importlib.import_module(module).add_arguments(p)


def run(args: argparse.Namespace) -> int:
    return importlib.import_module(SUBCOMMANDS[args.fleet_command][0]).run(args)

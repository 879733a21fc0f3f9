"""One CLI, `edgeinfer`: generate, embed, serve, router, ledger, fleet, bench, quantize, compress, eval.

A subcommand is a module with `add_arguments(parser)` and `run(args) -> int` (or `<name>_command` holding
both). The engine's commands live in this package (`generate`, `embed`, `quantize` / `compress`), with the
engine flags they share (`engine_args.py`); the rooms built on the engine own theirs (`node/cli.py`,
`router/`, `ledger/`, `fleet/`, `bench/`, `eval/`). This file only routes. Errors the user can fix end as one
line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from typing import NoReturn

# subcommand → (module, help). Modules import lazily so `edgeinfer generate` never loads the server.
COMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("edgeinfer.cli.generate", "generate a completion for one prompt (text to stdout)"),
    "embed": ("edgeinfer.cli.embed", "embed texts; print the vectors' shape and first values"),
    "serve": ("edgeinfer.node.cli", "run the node server (OpenAI and Workers-AI APIs)"),
    "router": ("edgeinfer.router.cli", "run the edge router in front of a fleet of nodes"),
    "ledger": (
        "edgeinfer.ledger.cli",
        "the fleet's usage ledger: stores every node's usage events from NATS, answers usage queries",
    ),
    "fleet": (
        "edgeinfer.fleet.cli",
        "a loopback fleet (`up`) and the fleet simulator (`simulate`)",
    ),
    "bench": ("edgeinfer.bench.cli", "benchmark a running OpenAI-compatible server"),
    "audit-cache": (
        "edgeinfer.bench.audit_cache",
        "measure whether a server's prompt cache leaks one tenant's prompts to another (TTFT, ROC AUC)",
    ),
    "quantize": ("edgeinfer.cli.quantize", "write a weight-quantized checkpoint"),
    "compress": ("edgeinfer.cli.quantize", "write a losslessly compressed BF16 checkpoint"),
    "eval": ("edgeinfer.eval.cli", "perplexity and divergence against a baseline"),
    "standby": (
        "edgeinfer.cli.standby.server",
        "keep torch and the engine imported; `serve`, `generate` and `embed` start as its forks",
    ),
}


class _Parser(argparse.ArgumentParser):
    """A usage mistake is one line, as every other error the user can fix (the usage of a command with
    dozens of flags would bury it; `--help` prints it)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _load(name: str):
    module = importlib.import_module(COMMANDS[name][0])
    return getattr(module, f"{name}_command", module)


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = _Parser(prog="edgeinfer", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging on stderr")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        # Only the chosen subcommand's module is imported to add its arguments.
        if name in argv:
            _load(name).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    """The process's entry point: a running standby (`edgeinfer standby`) runs the command if it can."""
    if argv is None:
        from edgeinfer.cli.standby.client import hand_off

        argv = sys.argv[1:]
        if (code := hand_off(argv)) is not None:
            return code
    return run_here(argv)


def run_here(argv: list[str]) -> int:
    """Run the command in this process."""
    args = build_parser(argv).parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return _load(args.command).run(args)
    except KeyboardInterrupt:
        return 130
    except (ValueError, FileNotFoundError, OSError) as e:
        print(f"edgeinfer {args.command}: error: {e}", file=sys.stderr)
        return 2

"""The batch queue's flags, the same on nodes and routers (whichever creates the stream first sets them)."""

from __future__ import annotations

import argparse

from edgeinfer.batch.settings import BatchSettings


def add_batch_flags(group: argparse._ArgumentGroup) -> None:
    defaults = BatchSettings()
    group.add_argument(
        "--batch-retention",
        type=float,
        default=defaults.retention_s,
        metavar="S",
        help="queued requests (the Batch API) and their results are kept this long "
        f"({defaults.retention_s:g})",
    )
    group.add_argument(
        "--batch-ack-wait",
        type=float,
        default=defaults.ack_wait_s,
        metavar="S",
        help="a queued entry whose node went silent this long goes to another node "
        f"({defaults.ack_wait_s:g})",
    )
    group.add_argument(
        "--batch-max-attempts",
        type=int,
        default=defaults.max_attempts,
        metavar="N",
        help=f"tries of a queued entry before it is answered with its error ({defaults.max_attempts})",
    )


def batch_settings(args: argparse.Namespace) -> BatchSettings:
    return BatchSettings(
        retention_s=args.batch_retention, ack_wait_s=args.batch_ack_wait, max_attempts=args.batch_max_attempts
    )

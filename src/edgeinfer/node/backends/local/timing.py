"""First-token timing: when the client sees it (optionally held to a bucket's end), and the gaps between
tokens."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time

from edgeinfer.node.backends.base import Outcome
from edgeinfer.node.backends.local.choice import Choice


async def hold_first_token(arrival: float, bucket_ms: int) -> None:
    """Timing hygiene (NodeLimits.ttft_bucket_ms): every first token waits for its bucket's end.
    Every one, not only hits': held alone, hits would land on bucket ends while misses do not, which tells
    them apart as surely as speed does."""
    bucket = bucket_ms / 1000.0
    if bucket <= 0:
        return
    elapsed = time.monotonic() - arrival
    await asyncio.sleep(math.ceil(elapsed / bucket) * bucket - elapsed)


def observe_tokens(choice: Choice, ids: list[int], now: float, arrival: float, outcome: Outcome) -> None:
    """The request's TTFT (its first token of any choice) or the inter-token gaps of `ids`, arriving now."""
    if choice.last_token_at is None:
        ttft = now - arrival
        if outcome.latency.ttft is None or ttft < outcome.latency.ttft:
            outcome.latency = dataclasses.replace(outcome.latency, ttft=ttft)
    else:
        gap = (now - choice.last_token_at) / len(ids)
        outcome.inter_token_latencies.extend([gap] * len(ids))
    choice.last_token_at = now
    choice.token_ids.extend(ids)

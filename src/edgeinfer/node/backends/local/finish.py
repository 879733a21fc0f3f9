"""A choice's end: its API finish reason, the request's latency as the client saw it, and the canaries
(engine errors, degenerate repetition) the metrics count."""

from __future__ import annotations

import dataclasses

from edgeinfer.api.errors import internal
from edgeinfer.node.backends.base import Outcome
from edgeinfer.node.backends.local.choice import Choice
from edgeinfer.obs.canary import DEGENERATE_REPETITION, NONFINITE_LOGITS, is_degenerate_repetition
from edgeinfer.obs.timing import LatencyBreakdown
from edgeinfer.types import FinishReason, RequestOutput

_FINISH = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.ABORT: "abort"}


def finish_choice(choice: Choice, index: int, out: RequestOutput, outcome: Outcome, e2e: float) -> str:
    """Mark the choice finished and return its finish reason (500 for an engine error); `e2e`: seconds from
    the request's arrival until now."""
    choice.finished = True
    if out.finish_reason == FinishReason.ERROR:
        outcome.canary.append(NONFINITE_LOGITS)
        raise internal(f"generation failed for choice {index}: {out.error or 'engine error'}")
    _record_latency(index, out, outcome, e2e)
    if DEGENERATE_REPETITION not in outcome.canary and is_degenerate_repetition(choice.token_ids):
        outcome.canary.append(DEGENERATE_REPETITION)
    return _FINISH.get(out.finish_reason or FinishReason.STOP, "stop")


def _record_latency(index: int, out: RequestOutput, outcome: Outcome, e2e: float) -> None:
    """The phases of choice 0's timeline; ttft and e2e are what the client sees: first token of any choice,
    last token of all."""
    latency = outcome.latency
    if index == 0:
        tl = out.timeline
        latency = LatencyBreakdown.from_timestamps(
            tl.arrival, tl.first_scheduled, tl.first_token, tl.finished
        )
    outcome.latency = dataclasses.replace(latency, ttft=outcome.latency.ttft, e2e=e2e)

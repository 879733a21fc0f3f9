"""What a backend streams back for a job, and the interface every kind of pool member's backend implements
(local engine, upstream server)."""

from __future__ import annotations

import abc
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

from edgeinfer.api.jobs import Job
from edgeinfer.obs.timing import LatencyBreakdown
from edgeinfer.types import Usage


@dataclass
class LogprobEntry:
    """One token's text and log-probability, with the top alternatives when asked for.

    `logprob` is None for the first prompt token (nothing precedes it).
    """

    token: str
    logprob: float | None
    top: list[tuple[str, float]] | None = None


@dataclass
class ChoiceDelta:
    """New text (and its logprobs) of one choice; `finish_reason` set on its last delta. Chat answers may
    also carry reasoning text and tool calls (OpenAI-shaped, each with its `index`)."""

    index: int
    text: str = ""
    logprobs: list[LogprobEntry] | None = None
    finish_reason: str | None = None
    reasoning: str = ""
    tool_calls: list[dict[str, Any]] | None = None


@dataclass
class Outcome:
    """Filled in by a backend while it runs a job; read by the service when the job ends."""

    usage: Usage = field(default_factory=Usage)
    latency: LatencyBreakdown = field(default_factory=LatencyBreakdown)
    inter_token_latencies: list[float] = field(default_factory=list)
    canary: list[str] = field(default_factory=list)
    version: str = ""


class Backend(abc.ABC):
    """Runs jobs on one leased pool member."""

    version: str

    @abc.abstractmethod
    def prepare(self, job: Job) -> int:
        """Validate the job against the member (context length, vocabulary) and return the tokens to
        reserve against the tenant's tokens/min limit. Raises ApiError."""

    @abc.abstractmethod
    def run(self, job: Job, outcome: Outcome) -> AsyncGenerator[ChoiceDelta, None]:
        """Stream the job's deltas; closing the iterator early aborts the generation."""

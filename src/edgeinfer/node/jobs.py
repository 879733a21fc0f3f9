"""The API-neutral form of a generation request and of what comes back, shared by both APIs and both
kinds of pool member (local engine, upstream server)."""

from __future__ import annotations

import abc
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

from edgeinfer.obs.timing import LatencyBreakdown
from edgeinfer.structured.tools import ToolChoice
from edgeinfer.types import SamplingParams, Usage

COMPLETION = "completion"
CHAT = "chat"


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
class Job:
    """One API request, normalized. `prompts` (completion) or `messages` (chat) is the input.

    Choice `i` of prompt `p` has index `p * n + i`. `max_tokens` None means "the rest of the context,
    capped by the server limit"; a default that is not `max_tokens_explicit` shrinks to fit the context.
    `upstream_body` is what an upstream member receives (the client's own body on the OpenAI routes).
    """

    request_id: str
    endpoint: str
    kind: str
    model: str
    sampling: SamplingParams
    max_tokens: int | None
    max_tokens_explicit: bool
    arrival: float
    prompts: list[str | list[int]] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    tools: list[dict[str, Any]] = field(default_factory=list)  # OpenAI-shaped, validated
    tool_choice: ToolChoice = field(default_factory=ToolChoice)
    parallel_tool_calls: bool = True
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    n: int = 1
    echo: bool = False
    logprobs: int | None = None
    stream: bool = False
    include_usage: bool = False
    reject_if_busy: bool = False
    upstream_path: str = "/v1/completions"
    upstream_body: dict[str, Any] = field(default_factory=dict)

    @property
    def num_choices(self) -> int:
        return self.n * max(1, len(self.prompts)) if self.kind == COMPLETION else self.n


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

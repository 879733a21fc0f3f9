"""The API-neutral form of a generation request, built from either API's body by `prepare` (on nodes and
routers alike) and run by a node's backends."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from edgeinfer.structured.tools import ToolChoice
from edgeinfer.types import SamplingParams
from edgeinfer.types.request import Lane


class JobKind(enum.StrEnum):
    """How the input reaches the model: raw prompts, or messages through the chat template."""

    COMPLETION = "completion"
    CHAT = "chat"


COMPLETION = JobKind.COMPLETION
CHAT = JobKind.CHAT


@dataclass(kw_only=True)
class Job:
    """One API request, normalized. `prompts` (completion) or `messages` (chat) is the input.

    Choice `i` of prompt `p` has index `p * n + i`. `max_tokens` None means "the rest of the context,
    capped by the server limit"; a default that is not `max_tokens_explicit` shrinks to fit the context.
    `upstream_body` is what an upstream member receives (the client's own body on the OpenAI routes).
    """

    request_id: str
    endpoint: str
    kind: JobKind
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
    priority: int = 0  # lower first, within the tenant's range (api/tenants.py)
    lane: Lane = Lane.INTERACTIVE  # batch: queued work (the Batch API), run where interactive leaves room
    adapter: str | None = None  # the tenant's LoRA adapter (`model: "base:adapter"`, Workers AI's `lora`)
    upstream_path: str = "/v1/completions"
    upstream_body: dict[str, Any] = field(default_factory=dict)

    @property
    def num_choices(self) -> int:
        return self.n * max(1, len(self.prompts)) if self.kind == COMPLETION else self.n

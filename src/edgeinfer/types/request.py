"""What crosses the node → engine door and comes back."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from edgeinfer.types.sampling import SamplingParams


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


class Lane(enum.StrEnum):
    """Which work goes first: interactive requests always; batch requests fill what is left (seats, KV
    blocks, each step's budget) and give their place back, preempted and later recomputed, when
    interactive work needs it."""

    INTERACTIVE = "interactive"
    BATCH = "batch"


@dataclass
class EngineRequest:
    """One generation request. `cache_namespace` is set by the server, never by a client;
    `tenant_weight` and `cache_share` are the tenant's weights in the fair share of prefill and of
    cached KV blocks (from the tenants file). `adapter` names a LoRA adapter the engine has registered
    (the node checks that it is the tenant's)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    tenant: str = ""
    model: str = ""
    priority: int = 0
    lane: Lane = Lane.INTERACTIVE
    arrival_time: float = field(default_factory=time.monotonic)
    cache_namespace: str = ""
    tenant_weight: float = 1.0
    cache_share: float = 1.0
    # A LoRA adapter registered on the engine (engine/lora/), by name; None: the base model.
    adapter: str | None = None


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class TokenLogprob:
    """The chosen token's log-probability and, when asked, the top alternatives."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class Timeline:
    """Monotonic timestamps of one request's life; the node turns them into latency metrics."""

    arrival: float = 0.0
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None


@dataclass
class RequestOutput:
    """A delta: the tokens and text produced since the previous output of the same request."""

    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    finish_reason: FinishReason | None = None
    usage: Usage = field(default_factory=Usage)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    timeline: Timeline = field(default_factory=Timeline)
    error: str | None = None

"""The engine's view of one request: its tokens, progress and state."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from edgeinfer.types import EngineRequest, FinishReason, SamplingParams
from edgeinfer.types.request import Lane


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass
class Request:
    """`num_computed_tokens` catches up with `num_tokens` (prompt + generated). Prefill, chunked prefill,
    prefix hits and recompute after preemption are all that one rule; no phase flags."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    priority: int = 0
    lane: Lane = Lane.INTERACTIVE
    arrival_time: float = 0.0
    cache_namespace: str = ""
    tenant: str = ""
    weight: float = 1.0  # the tenant's weight in the fair share of prefill (fairness.py)
    cache_share: float = 1.0  # the tenant's weight in the share of cached blocks (kv_cache/eviction.py)
    enqueue_time: float = 0.0
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    first_scheduled_time: float | None = None

    @classmethod
    def from_engine_request(cls, req: EngineRequest, eos: frozenset[int], now: float) -> Request:
        return cls(
            request_id=req.request_id,
            prompt_token_ids=list(req.prompt_token_ids),
            sampling=req.sampling,
            eos_token_ids=frozenset() if req.sampling.ignore_eos else eos,
            priority=req.priority,
            lane=req.lane,
            arrival_time=req.arrival_time,
            cache_namespace=req.cache_namespace,
            tenant=req.tenant,
            weight=req.tenant_weight,
            cache_share=req.cache_share,
            enqueue_time=now,
        )

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens whose KV is not computed yet: 1 for a decoding request, more while it prefills."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_batch(self) -> bool:
        return self.lane is Lane.BATCH

    @property
    def is_prefilling(self) -> bool:
        return self.num_uncomputed_tokens > 1

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status in (RequestStatus.FINISHED, RequestStatus.ABORTED)

    def check_stop(self, token: int, max_model_len: int) -> FinishReason | None:
        """Token-level stop rules after appending `token`; stop strings are the detokenizer's job."""
        n_out = len(self.output_token_ids)
        if n_out >= self.sampling.min_tokens and (
            token in self.eos_token_ids or token in self.sampling.stop_token_ids
        ):
            return FinishReason.STOP
        if n_out >= self.sampling.max_tokens or self.num_tokens >= max_model_len:
            return FinishReason.LENGTH
        return None

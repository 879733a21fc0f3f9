"""Continuous batching over one token budget per step.

Each step: running requests first — decodes before partial prefills, so a long prompt never delays
the token of anyone already generating — then waiting requests are admitted while seats, budget and KV
blocks last. When a running request needs a block and none is free, the most recently admitted
(or, with the priority policy, the least important) unscheduled request is preempted: its blocks are
freed and it is recomputed later from its tokens, which the prefix cache often still holds.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from edgeinfer.engine.kv_cache import KVCacheManager
from edgeinfer.engine.kv_cache.manager import blocks_for
from edgeinfer.engine.scheduler.output import ScheduledChunk, SchedulerOutput
from edgeinfer.engine.scheduler.queue import make_queue
from edgeinfer.engine.scheduler.request import Request, RequestStatus
from edgeinfer.types import FinishReason


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    batch_window_ms: float = 0.0
    policy: str = "fcfs"


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, kv: KVCacheManager, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config
        self.kv = kv
        self.clock = clock
        self.waiting = make_queue(config.policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self._finished: list[str] = []

    # ---- requests in and out -------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        """Queue a request; ValueError if it could never run (too long for the context or the pool)."""
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        n = req.num_prompt_tokens
        if n == 0:
            raise ValueError("the prompt is empty")
        if n >= self.config.max_model_len:
            raise ValueError(
                f"the prompt has {n} tokens; this model's context is {self.config.max_model_len} "
                "tokens including at least one generated token"
            )
        if blocks_for(n + 1, self.kv.block_size) > self.kv.pool.num_blocks:
            raise ValueError(f"the prompt has {n} tokens, more than the KV cache can ever hold")
        req.enqueue_time = self.clock()
        self.requests[req.request_id] = req
        self.waiting.push(req)

    def abort(self, request_id: str) -> Request | None:
        return self.finish(request_id, FinishReason.ABORT)

    def finish(self, request_id: str, reason: FinishReason) -> Request | None:
        """End a request from outside the step (abort, stop string, error); frees its blocks."""
        req = self.requests.get(request_id)
        if req is None or req.is_finished:
            return None
        self._finish(req, reason)
        return req

    def _finish(self, req: Request, reason: FinishReason) -> None:
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(req.request_id)
        self.kv.free(req.request_id)
        req.status = RequestStatus.ABORTED if reason == FinishReason.ABORT else RequestStatus.FINISHED
        req.finish_reason = reason
        del self.requests[req.request_id]
        self._finished.append(req.request_id)

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    def next_admission_time(self) -> float | None:
        """When the micro-batch window of the oldest waiting request closes (None: nothing waits)."""
        if not len(self.waiting):
            return None
        return self.waiting.peek().enqueue_time + self.config.batch_window_ms / 1000.0

    # ---- one step --------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        out = SchedulerOutput()
        scheduled: set[str] = set()
        # Decodes (one token owed) before partial prefills; sorted() is stable, so arrival order holds.
        for req in sorted(self.running, key=lambda r: r.num_tokens - r.num_computed_tokens > 1):
            if budget == 0:
                break
            if req.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            table = self._allocate_or_preempt(req, n, scheduled, out)
            if table is None:
                continue
            out.chunks.append(self._chunk(req, n, table))
            scheduled.add(req.request_id)
            budget -= n
        if not out.preempted and self._admission_open():
            self._admit(budget, out)
        out.finished = self._finished
        self._finished = []
        return out

    def _allocate_or_preempt(
        self, req: Request, n: int, scheduled: set[str], out: SchedulerOutput
    ) -> list[int] | None:
        while True:
            table = self.kv.allocate(req.request_id, req.num_computed_tokens + n)
            if table is not None:
                return table
            victim = self._pick_victim(scheduled)
            self._preempt(victim)
            out.preempted.append(victim.request_id)
            if victim is req:
                return None

    def _pick_victim(self, scheduled: set[str]) -> Request:
        candidates = [r for r in self.running if r.request_id not in scheduled]
        if self.config.policy == "priority":
            return max(candidates, key=lambda r: (r.priority, r.arrival_time))
        return candidates[-1]

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req.request_id)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push_front(req)

    def _admission_open(self) -> bool:
        """The micro-batch window: fresh requests wait until the oldest has waited `batch_window_ms`,
        unless they already fill every free seat. Preempted requests never wait."""
        if not len(self.waiting) or self.config.batch_window_ms <= 0:
            return True
        head = self.waiting.peek()
        free_seats = self.config.max_num_seqs - len(self.running)
        return (
            head.num_preemptions > 0
            or len(self.waiting) >= free_seats
            or self.clock() >= self.next_admission_time()
        )

    def _admit(self, budget: int, out: SchedulerOutput) -> None:
        while len(self.waiting) and len(self.running) < self.config.max_num_seqs and budget > 0:
            req = self.waiting.peek()
            tokens = req.all_token_ids
            prefix, cached = [], 0
            if req.sampling.prompt_logprobs is None:  # prompt logprobs need every prompt row computed
                prefix, cached = self.kv.lookup(req.cache_namespace, tokens)
            n = min(len(tokens) - cached, budget)
            table = self.kv.allocate(req.request_id, cached + n, prefix, req.cache_namespace)
            if table is None:
                break
            self.waiting.pop()
            if req.num_preemptions == 0:
                req.num_cached_tokens = cached
                req.first_scheduled_time = self.clock()
            req.num_computed_tokens = cached
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.chunks.append(self._chunk(req, n, table))
            budget -= n

    @staticmethod
    def _chunk(req: Request, n: int, table: list[int]) -> ScheduledChunk:
        start = req.num_computed_tokens
        return ScheduledChunk(
            request_id=req.request_id,
            token_ids=req.all_token_ids[start : start + n],
            start=start,
            block_ids=list(table),
            sample=start + n == req.num_tokens,
            sampling=req.sampling,
            prompt_token_ids=req.prompt_token_ids,
            output_token_ids=list(req.output_token_ids),
            num_prompt_tokens=req.num_prompt_tokens,
            eos_token_ids=req.eos_token_ids,
        )

    # ---- after the step --------------------------------------------------------------------------
    def update(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Advance progress, append sampled tokens, apply token-level stops. Returns the requests that
        received a token this step (finished ones included)."""
        touched = []
        for chunk in out.chunks:
            req = self.requests.get(chunk.request_id)
            if req is None or req.status != RequestStatus.RUNNING:
                continue  # finished or aborted while the step ran
            req.num_computed_tokens += chunk.num_tokens
            reason = None
            if chunk.sample and chunk.request_id in sampled:
                token = sampled[chunk.request_id]
                req.output_token_ids.append(token)
                reason = req.check_stop(token, self.config.max_model_len)
                touched.append(req)
            self.kv.cache_full_blocks(req.request_id, req.all_token_ids, req.num_computed_tokens)
            if reason is not None:
                self._finish(req, reason)
        return touched

    def check_integrity(self) -> None:
        self.kv.check_integrity()
        running = {r.request_id for r in self.running}
        if set(self.kv.tables) - running:
            raise AssertionError(
                f"blocks held by requests not running: {sorted(set(self.kv.tables) - running)}"
            )

"""Continuous batching over one token budget per step.

Each step: running requests first — decodes before partial prefills, so a long prompt never delays
the token of anyone already generating — then waiting requests are admitted while seats, budget and KV
blocks last. When a running request needs a block and none is free, the most recently admitted
(or, with the priority policy, the least important) unscheduled request is preempted: its blocks are
freed and it is recomputed later from its tokens, which the prefix cache often still holds.

Interactive requests come before batch ones everywhere (types.request.Lane): in the waiting queue, in
each step's budget, and for seats and KV blocks, which a batch request gives up (preempted, recomputed
later) when an interactive one needs them; batch work fills what is left, and sits out every step that
prefills interactive work, so that a first token never waits on batch decodes.

With `fair_share` (the default), prefill work — running requests still prefilling and waiting ones —
is handed out across tenants by weighted fair share (fairness.py) instead of in arrival order across
everyone; within a tenant, and under the priority policy across tenants, the old order holds. A step
that brings a tenant's request its first token carries little of the other tenants' prefill, so that
token is not held back by someone else's long prompt.

With `max_step_ms`, the step's token budget is what fits in that time by the cost of recent steps
(step_cost.py), so that no request arriving while a step runs waits on more than one step-time of
someone's long prompt. A request alone (nothing else unfinished, no other tenant present) takes the
whole `max_num_batched_tokens` instead: small chunks only cost it (each re-reads its context), and a
newcomer then waits for at most one such step. While more than one tenant is present (has requests, or
had one in the last `PRESENCE_S`: interactive users send again soon), the shorter `shared_step_ms` holds:
a tenant's first token then waits for little of another's prefill, which pays in prefill throughput
(smaller chunks).

With `speculative` set, a decoding request may carry draft tokens (drafting.py) while few requests
decode: its chunk is its last token plus the drafts, the runner verifies them in the step, and `update`
appends what was accepted. Only verified tokens ever count as computed, so the prefix cache never indexes
a block holding a rejected draft, and blocks taken only for rejected drafts go back to the pool at once.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from edgeinfer.engine.kv_cache import KVCacheManager
from edgeinfer.engine.kv_cache.manager import Tables
from edgeinfer.engine.scheduler.drafting import SpecConfig, make_drafter
from edgeinfer.engine.scheduler.fairness import FairShare
from edgeinfer.engine.scheduler.mixed_cost import MixedStepCost
from edgeinfer.engine.scheduler.output import ScheduledChunk, SchedulerOutput
from edgeinfer.engine.scheduler.queue import SchedulingPolicy
from edgeinfer.engine.scheduler.request import Request, RequestStatus
from edgeinfer.engine.scheduler.step_cost import StepCost
from edgeinfer.types import FinishReason


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    batch_window_ms: float = 0.0
    policy: SchedulingPolicy = SchedulingPolicy.FCFS
    fair_share: bool = True
    max_step_ms: float | None = None
    shared_step_ms: float | None = None
    batch_step_ms: float | None = None
    # the runner drops a batch-only step when interactive work arrives (runner/interrupt.py), so such a
    # step need not be short to keep a newcomer's wait short
    interruptible_steps: bool = False
    speculative: SpecConfig | None = None


# Fewest prefill tokens a time-budgeted step offers (a slow machine still makes progress), and the part
# of a step's budget left to other tenants' prefill when it brings a tenant's request its first token.
MIN_PREFILL_CHUNK = 16
FIRST_TOKEN_SHARE = 4
# A tenant counts as present this long after its last request arrived or ended.
PRESENCE_S = 1.0
# Without interruptible steps, batch steps are kept short (`batch_step_ms`) while interactive requests run
# or arrived this recently: a node with batch work only (a nightly job) runs it in full steps, and the first
# interactive request after such a lull waits one such step.
INTERACTIVE_PRESENCE_S = 30.0


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, kv: KVCacheManager, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config
        self.kv = kv
        self.clock = clock
        self.waiting = config.policy.queue()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.fair = FairShare()
        self.cost = StepCost()
        self.mixed_cost = MixedStepCost()  # decode rows and prefill tokens apart
        self._seen: dict[str, float] = {}  # tenant -> when its last request arrived or ended
        self._finished: list[str] = []
        self.drafter = make_drafter(config.speculative)
        self._speculate = False  # whether this step's decodes may carry drafts
        # where this step's round of batch decodes starts, and how many the last step served
        self._batch_turn = self._batch_served = 0
        self._interactive_at = float("-inf")  # when the last interactive request arrived
        # per draft source: tokens drafted, and of those accepted (the runner's verification kept them)
        self.spec_drafted: Counter[str] = Counter()
        self.spec_accepted: Counter[str] = Counter()

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
        if self.kv.peak_blocks(n + 1, self.config.max_num_batched_tokens) > self.kv.pool.num_blocks:
            raise ValueError(f"the prompt has {n} tokens, more than the KV cache can ever hold")
        req.enqueue_time = self.clock()
        if not req.is_batch:
            self._interactive_at = req.enqueue_time
        self._seen[req.tenant] = req.enqueue_time
        self.kv.pool.set_share(req.tenant, req.cache_share)
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
        if self.drafter is not None:
            self.drafter.forget(req.request_id)
        self._seen[req.tenant] = self.clock()
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
    def observe_step(self, tokens: int, seconds: float, decode_rows: int = 0) -> None:
        """How long the step just run took (`decode_rows` of its `tokens` were decode rows); with
        `max_step_ms` the next budgets follow it, and the steps beside interactive decodes follow the model
        that tells decode rows from prefill tokens (scheduler/mixed_cost.py)."""
        self.cost.observe(tokens, seconds)
        self.mixed_cost.observe(decode_rows, tokens - decode_rows, seconds)

    def step_budget(self) -> int:
        """Tokens this step may schedule: the configured maximum, or what fits in the step-time target."""
        highest = self.config.max_num_batched_tokens
        target = self.config.max_step_ms
        present = self._tenants_present()
        if self.config.shared_step_ms is not None and present > 1:
            target = self.config.shared_step_ms
        if target is None or (len(self.requests) <= 1 and present <= 1):
            return highest
        lowest = min(highest, len(self.running) + MIN_PREFILL_CHUNK)
        return self.cost.tokens_within(target / 1000.0, lowest, highest)

    def _tenants_present(self) -> int:
        since = self.clock() - PRESENCE_S
        self._seen = {t: at for t, at in self._seen.items() if at >= since}
        return len(self._seen.keys() | {r.tenant for r in self.requests.values()})

    def schedule(self) -> SchedulerOutput:
        budget = self.step_budget()
        out = SchedulerOutput()
        scheduled: set[str] = set()
        # While interactive work prefills, batch work sits the step out: its decodes and prefill would
        # lengthen the step that brings an interactive request its first token.
        hold = self._interactive_prefill()
        running = [r for r in self.running if not r.is_batch] if hold else self._batch_in_turn()
        decodes_only = False
        if not hold and (self.num_batch_running() or self.waiting.num_batch):
            budget, decodes_only = self._batch_budget(budget)
        if decodes_only:  # batch prefill would lengthen the interactive streams' step: it waits for its own
            running = [r for r in running if not r.is_prefilling]
        # Decodes (one token owed) before partial prefills; sorted() is stable, so arrival order holds.
        ordered = sorted(running, key=lambda r: (r.is_prefilling, r.is_batch))
        prefills = [r for r in ordered if r.is_prefilling]
        spec = self.config.speculative
        # A draft model's k steps would lengthen a step that prefills others too: it drafts only while few
        # requests run at all, when it also prefills their prompts (`few_running`).
        model_drafts = self.drafter is not None and self.drafter.in_runner
        busy = len(self.running) if model_drafts else len(ordered) - len(prefills)
        self._speculate = spec is not None and busy <= spec.max_batch
        for req in ordered if not self.config.fair_share else ordered[: len(ordered) - len(prefills)]:
            if budget == 0:
                break
            budget -= self._continue(req, budget, scheduled, out)
        admit = not out.preempted and self._admission_open() and not decodes_only
        if self.config.fair_share:
            self._fair_prefill(prefills, budget, admit, scheduled, out, hold)
        elif admit:
            self._admit(budget, scheduled, out, hold)
        # few enough requests run that their decodes will draft: a draft model prefills their prompts now
        out.few_running = spec is not None and len(self.running) <= spec.max_batch
        out.finished = self._finished
        self._finished = []
        self._batch_served = sum(self.requests[c.request_id].is_batch for c in out.chunks)
        out.interruptible = bool(out.chunks) and self._batch_served == len(out.chunks)
        return out

    def abandon(self, out: SchedulerOutput) -> None:
        """The step `out` did not run (interactive work stopped it): its batch requests have not had
        their turn. Everything else stands: its requests keep their seats and blocks and are scheduled
        again from where they were."""
        self._batch_served = 0

    def _continue(self, req: Request, budget: int, scheduled: set[str], out: SchedulerOutput) -> int:
        """Schedule a running request's next tokens; returns how many (0: it was preempted)."""
        if req.status != RequestStatus.RUNNING:
            return 0  # preempted earlier in this step
        n = min(req.num_uncomputed_tokens, budget)
        drafts = self._drafts(req, budget) if req.num_uncomputed_tokens == 1 else []
        # a guess never preempts anyone: without blocks for the drafts the request decodes plainly
        table = self.kv.allocate(req.request_id, req.num_tokens + len(drafts)) if drafts else None
        if table is None:
            drafts = []
            table = self._allocate_or_preempt(req, n, scheduled, out)
        if table is None:
            return 0
        out.chunks.append(self._chunk(req, n, table, drafts))
        scheduled.add(req.request_id)
        return n + len(drafts)

    def _drafts(self, req: Request, budget: int) -> list[int]:
        """Draft tokens for a decoding request: none unless speculation is on for this step and the
        request allows it; never more than could be emitted (max_tokens, the context) or fit the budget."""
        if self.drafter is None or not self._speculate or not req.sampling.speculative:
            return []
        limit = min(
            self.drafter.length(req.request_id),
            budget - 1,
            req.sampling.max_tokens - len(req.output_token_ids) - 1,
            self.config.max_model_len - req.num_tokens - 1,
        )
        return self.drafter.propose(req, limit) if limit > 0 else []

    def _fair_prefill(
        self,
        prefills: list[Request],
        budget: int,
        admit: bool,
        scheduled: set[str],
        out: SchedulerOutput,
        hold: bool,
    ) -> None:
        """Give the budget, one request's chunk at a time, to the least-served tenant with prefill work
        (`hold`: interactive work only)."""
        waiting = [r for r in self.waiting if not (hold and r.is_batch)] if admit else []
        lanes = self._lanes(prefills, waiting)
        self.fair.start_step(set(lanes))
        first_token_for: str | None = None  # a tenant whose request gets its first token this step
        share = budget // FIRST_TOKEN_SHARE
        others = budget  # what other tenants' prefill may still take once there is one
        while budget > 0 and lanes:
            # least served first; on a tie (a tenant that just arrived), the shortest prefill
            tenant = min(
                lanes,
                key=lambda t: (
                    self._rank(lanes[t][0][0]),
                    self.fair.service[t],
                    lanes[t][0][0].num_uncomputed_tokens,
                ),
            )
            req, waiting = lanes[tenant].popleft()
            if not lanes[tenant]:
                del lanes[tenant]
            offer = budget if first_token_for in (None, tenant) else min(budget, others)
            if offer == 0:
                continue
            if not waiting:
                n = self._continue(req, offer, scheduled, out)
            elif not self._seat_for(req, scheduled, out):
                n = 0  # no seat (or blocks are short): waiting requests stay queued this step
            else:
                n = self._admit_one(req, offer, out)
                while n is None and self._make_room(req, scheduled, out):
                    n = self._admit_one(req, offer, out)
                n = n or 0
                if n == 0:  # the pool is short: admit no one this step (as FCFS stops at its head)
                    lanes = _running_only(lanes)
                    continue
                self.waiting.remove(req.request_id)
            if first_token_for not in (None, tenant):
                others -= n
            elif n and _brings_first_token(req, out):
                first_token_for = tenant
                others = min(budget - n, share)
            self.fair.charge(tenant, n, req.weight)
            budget -= n

    def num_batch_running(self) -> int:
        """Batch-lane requests running; also read by the engine's stats without its lock (a copy)."""
        return sum(r.is_batch for r in list(self.running))

    def _batch_in_turn(self) -> list[Request]:
        """The running requests, the batch ones starting after those the last step served: when a step's
        budget cannot take every batch decode, they take turns."""
        batch = [r for r in self.running if r.is_batch]
        if not batch:
            return self.running
        self._batch_turn = (self._batch_turn + self._batch_served) % len(batch)
        interactive = [r for r in self.running if not r.is_batch]
        return interactive + batch[self._batch_turn :] + batch[: self._batch_turn]

    def _batch_budget(self, budget: int) -> tuple[int, bool]:
        """(tokens, whether the step holds decodes only) for a step with batch work. Beside interactive
        decodes it holds decodes only, as many as fit in `batch_step_ms` by the line of such steps (every
        interactive decode, at least): an interactive request arriving meanwhile waits about that for the
        step in flight, and the running ones' tokens come that often. A batch-only step takes the whole
        budget where steps are interruptible, else only while no interactive request came of late."""
        if self.config.batch_step_ms is None:
            return budget, False
        seconds = self.config.batch_step_ms / 1000.0
        lowest = len(self.running) - self.num_batch_running() + 1
        if lowest > 1:
            return self._beside_interactive_decodes(seconds, min(lowest, budget), budget)
        if self.config.interruptible_steps:
            # a batch-only step: an interactive arrival stops it at its next layer, so neither the step
            # time target nor other tenants' presence need keep it short
            return self.config.max_num_batched_tokens, False
        if self.clock() - self._interactive_at > INTERACTIVE_PRESENCE_S:
            return budget, False  # no interactive traffic of late: batch work runs at full throughput
        return self.cost.tokens_within(seconds, min(lowest, budget), budget), False

    def _beside_interactive_decodes(self, seconds: float, lowest: int, budget: int) -> tuple[int, bool]:
        """The decodes that fit in `seconds` by the model of decode rows and prefill tokens; where every
        running decode fits, batch prefill in the time left. Until the model has a fit, every running
        decode and a short prefill chunk: sized by the line of all steps (whose fixed cost is that of
        prefill steps) such a step would hold one batch decode, and the next one too."""
        decodes = sum(not r.is_prefilling for r in self.running)
        planned = self.mixed_cost.plan(seconds, decodes, lowest, budget)
        if planned is None:
            return min(budget, max(lowest, decodes) + MIN_PREFILL_CHUNK), False
        return planned

    def _interactive_prefill(self) -> bool:
        """Whether an interactive request waits or prefills (its first token is owed)."""
        if len(self.waiting) > self.waiting.num_batch:
            return True
        return any(r.is_prefilling and not r.is_batch for r in self.running)

    def _seat_for(self, req: Request, scheduled: set[str], out: SchedulerOutput) -> bool:
        """Whether waiting `req` may be admitted now: a free seat and no preemption for blocks this step.
        An interactive request takes a batch request's seat where none is free."""
        if len(out.preempted) > out.yielded:
            return False  # blocks are short: admitting now would preempt again
        if len(self.running) < self.config.max_num_seqs:
            return True
        return not req.is_batch and self._preempt_batch(scheduled, out)

    def _preempt_batch(self, scheduled: set[str], out: SchedulerOutput) -> bool:
        """Preempt a batch request for an interactive one: the latest admitted of those not scheduled this
        step, else of those scheduled (its chunk is taken out of the step); False: there is none."""
        batch = [r for r in self.running if r.is_batch]
        if not batch:
            return False
        victim = ([r for r in batch if r.request_id not in scheduled] or batch)[-1]
        if victim.request_id in scheduled:
            scheduled.discard(victim.request_id)
            out.chunks = [c for c in out.chunks if c.request_id != victim.request_id]
        self._preempt(victim)
        out.preempted.append(victim.request_id)
        out.yielded += 1
        return True

    def _make_room(self, req: Request, scheduled: set[str], out: SchedulerOutput) -> bool:
        """The pool is too short for `req`: an interactive request takes a batch request's blocks; else
        preempt the latest unscheduled request of the tenant whose running requests hold the most blocks,
        if that is more than `req`'s tenant would hold with it admitted — a tenant filling the pool gives
        way to one waiting with little. False: no such one."""
        if not req.is_batch and self._preempt_batch(scheduled, out):
            return True
        held: Counter[str] = Counter()
        for r in self.running:
            held[r.tenant] += self.kv.num_held(r.request_id)
        mine = held[req.tenant] + self.kv.peak_blocks(req.num_tokens + 1, self.config.max_num_batched_tokens)
        candidates = [
            r
            for r in self.running
            if r.request_id not in scheduled and r.tenant != req.tenant and held[r.tenant] > mine
        ]
        if not candidates:
            return False
        heaviest = max(held[r.tenant] for r in candidates)
        victim = [r for r in candidates if held[r.tenant] == heaviest][-1]
        self._preempt(victim)
        out.preempted.append(victim.request_id)
        return True

    def _lanes(
        self, prefills: list[Request], waiting: list[Request]
    ) -> dict[str, deque[tuple[Request, bool]]]:
        """Per tenant, its prefill work in scheduling order: (request, is it waiting)."""
        items = [(r, False) for r in prefills] + [(r, True) for r in waiting]
        if self.config.policy.by_priority:
            items.sort(key=lambda i: (i[0].is_batch, i[0].priority, i[1], i[0].arrival_time))
        else:
            items.sort(key=lambda i: i[0].is_batch)  # stable: each lane keeps its order
        lanes: dict[str, deque[tuple[Request, bool]]] = {}
        for item in items:
            lanes.setdefault(item[0].tenant, deque()).append(item)
        return lanes

    def _rank(self, req: Request) -> tuple[bool, int]:
        """Lanes, then priority classes, come before fairness: interactive work, and then a more important
        request, goes first whoever sent it."""
        return req.is_batch, req.priority if self.config.policy.by_priority else 0

    def _allocate_or_preempt(
        self, req: Request, n: int, scheduled: set[str], out: SchedulerOutput
    ) -> Tables | None:
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
        candidates = [r for r in candidates if r.is_batch] or candidates  # batch work gives way first
        if self.config.policy.by_priority:
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

    def _admit(self, budget: int, scheduled: set[str], out: SchedulerOutput, hold: bool) -> None:
        """Admit waiting requests in queue order (`hold`: up to the first batch one)."""
        while len(self.waiting) and budget > 0 and self._seat_for(self.waiting.peek(), scheduled, out):
            req = self.waiting.peek()
            if hold and req.is_batch:
                break
            n = self._admit_one(req, budget, out)
            while n is None and not req.is_batch and self._preempt_batch(scheduled, out):
                n = self._admit_one(req, budget, out)
            if n is None:
                break
            self.waiting.pop()
            budget -= n

    def _admit_one(self, req: Request, budget: int, out: SchedulerOutput) -> int | None:
        """Start (or restart) a waiting request with up to `budget` tokens; None when the KV pool lacks
        blocks for it. The caller takes it off the waiting queue."""
        tokens = req.all_token_ids
        prefix = None
        if req.sampling.prompt_logprobs is None:  # prompt logprobs need every prompt row computed
            prefix = self.kv.lookup(req.cache_namespace, tokens)
        cached = prefix.num_tokens if prefix is not None else 0
        n = min(len(tokens) - cached, budget)
        table = self.kv.allocate(
            req.request_id, cached + n, prefix, req.cache_namespace, req.tenant, self._prefill_reserve()
        )
        if table is None:
            return None
        if req.num_preemptions == 0:
            req.num_cached_tokens = cached
            req.first_scheduled_time = self.clock()
        req.num_computed_tokens = cached
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        out.chunks.append(self._chunk(req, n, table))
        return n

    def _prefill_reserve(self) -> int:
        """Blocks the running requests still need to finish their prompts: a new request is admitted only
        beside them, or admitting it would preempt one of them mid-prompt (and then another, in turn)."""
        chunk = self.config.max_num_batched_tokens
        prefilling = [r for r in self.running if r.is_prefilling]
        return sum(self.kv.blocks_short(r.request_id, r.num_tokens, chunk) for r in prefilling)

    @staticmethod
    def _chunk(req: Request, n: int, tables: Tables, drafts: list[int] | None = None) -> ScheduledChunk:
        start = req.num_computed_tokens
        return ScheduledChunk(
            request_id=req.request_id,
            token_ids=req.all_token_ids[start : start + n] + (drafts or []),
            start=start,
            block_ids=[list(t) for t in tables],
            sample=start + n == req.num_tokens,
            sampling=req.sampling,
            prompt_token_ids=req.prompt_token_ids,
            output_token_ids=list(req.output_token_ids),
            num_prompt_tokens=req.num_prompt_tokens,
            eos_token_ids=req.eos_token_ids,
            draft_token_ids=drafts or [],
        )

    # ---- after the step --------------------------------------------------------------------------
    def update(self, out: SchedulerOutput, sampled: Mapping[str, int | list[int]]) -> list[Request]:
        """Advance progress, append sampled tokens (a request's token, or its tokens where drafts were
        accepted), apply token-level stops. Returns the requests that received tokens this step (finished
        ones included); how many each got is its output's growth since its chunk was scheduled."""
        touched = []
        for chunk in out.chunks:
            req = self.requests.get(chunk.request_id)
            if req is None or req.status != RequestStatus.RUNNING:
                continue  # finished or aborted while the step ran
            appended, reason = 0, None
            if chunk.sample and chunk.request_id in sampled:
                got = sampled[chunk.request_id]
                appended, reason = self._append(req, [got] if isinstance(got, int) else got)
                touched.append(req)
            if chunk.draft_token_ids:
                self._count_drafts(chunk, appended)
                # the last token and the accepted drafts (each emitted token's predecessor) are computed;
                # the KV written for rejected drafts lies past that and is overwritten later
                req.num_computed_tokens += max(appended, 1)
                self.kv.trim(req.request_id, req.num_tokens)
            else:
                req.num_computed_tokens += chunk.num_tokens
            self.kv.commit(req.request_id, req.all_token_ids, req.num_computed_tokens)
            if reason is not None:
                self._finish(req, reason)
        return touched

    def _append(self, req: Request, tokens: list[int]) -> tuple[int, FinishReason | None]:
        """Append tokens up to the first that stops the request (the rest are never emitted)."""
        for i, token in enumerate(tokens):
            req.output_token_ids.append(token)
            reason = req.check_stop(token, self.config.max_model_len)
            if reason is not None:
                return i + 1, reason
        return len(tokens), None

    def _count_drafts(self, chunk: ScheduledChunk, appended: int) -> None:
        assert self.drafter is not None
        drafted, accepted = len(chunk.draft_token_ids), max(appended - 1, 0)
        self.spec_drafted[self.drafter.source] += drafted
        self.spec_accepted[self.drafter.source] += accepted
        self.drafter.observe(chunk.request_id, drafted, accepted)

    def check_integrity(self) -> None:
        self.kv.check_integrity()
        running = {r.request_id for r in self.running}
        if set(self.kv.tables) - running:
            raise AssertionError(
                f"blocks held by requests not running: {sorted(set(self.kv.tables) - running)}"
            )


def _brings_first_token(req: Request, out: SchedulerOutput) -> bool:
    """The chunk just scheduled is `req`'s and samples its first token."""
    chunk = out.chunks[-1] if out.chunks else None
    return (
        chunk is not None and chunk.request_id == req.request_id and chunk.sample and not req.output_token_ids
    )


def _running_only(lanes: dict[str, deque[tuple[Request, bool]]]) -> dict[str, deque[tuple[Request, bool]]]:
    kept = {t: deque(item for item in q if not item[1]) for t, q in lanes.items()}
    return {t: q for t, q in kept.items() if q}

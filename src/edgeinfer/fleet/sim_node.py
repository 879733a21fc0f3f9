"""One simulated accelerator: resident models under a memory budget, continuous batching, a prefix cache.

The node runs one SimPy process that mirrors our engine's step loop: when requests wait and a model has
room (batch slots, KV tokens), the next step is a prefill of everything admitted (its time from the profile's
prefill throughput, for the tokens not already in the prefix cache; the first token comes out of it);
otherwise every running request advances one token per decode step, whose time depends on each model's batch
size and context. Steps of different resident models run one after another, so a node with two busy models
takes the sum of their step times (they share the accelerator).

Decode steps are not simulated one by one: the node computes how many steps run until the next request
finishes and sleeps that long, waking early only when a new request can join the batch; it then completes the
step in progress (requests join at step boundaries, as in the engine) and admits. The node's work runs on
its CPU (sim_host): a processor of its own, or cores it shares with other nodes on one host.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import simpy

from edgeinfer.fleet.sim_host import Dedicated, SharedHost
from edgeinfer.fleet.sim_profile import ModelProfile


@dataclass(frozen=True, kw_only=True)
class NodeShape:
    """One simulated accelerator's size: its memory, batch slots per model, and when it counts as busy."""

    memory_gb: float
    max_batch: int
    busy_queue: int
    max_batched_tokens: int


class Board:
    """Fleet-wide arrays the nodes keep current, so fleet-wide baselines pick a node without a Python loop."""

    def __init__(self, num_nodes: int, num_models: int) -> None:
        self.in_flight = np.zeros(num_nodes)
        self.capacity = np.ones(num_nodes)
        self.saturated = np.zeros(num_nodes, dtype=bool)
        self.warm = np.zeros((num_models, num_nodes), dtype=bool)


class SimRequest:
    __slots__ = ("arrival", "cached", "context", "generated", "idx", "model", "output", "prefix_key",
                 "prefix_len", "prompt", "rtt_s")  # fmt: skip

    def __init__(self, *, idx, model, prompt, output, prefix_key, prefix_len, arrival, rtt_s) -> None:
        self.idx, self.model, self.prompt, self.output = idx, model, prompt, output
        self.prefix_key, self.prefix_len, self.arrival, self.rtt_s = prefix_key, prefix_len, arrival, rtt_s
        self.generated = 0
        self.context = prompt
        self.cached = 0


class ModelSlot:
    """One resident (or loading) model on a node: its queue, running batch, KV budget and prefix cache."""

    def __init__(self, model: int, profile: ModelProfile, ready_at: float) -> None:
        self.model, self.profile, self.ready_at = model, profile, ready_at
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.reserved = 0  # KV tokens held by running requests beyond their cached prefix
        self.cache: OrderedDict[int, int] = OrderedDict()  # prefix key -> tokens, least recently used first
        self.cache_tokens = 0
        self.last_used = ready_at

    def cached_tokens(self, req: SimRequest) -> int:
        if req.prefix_key and req.prefix_key in self.cache:
            self.cache.move_to_end(req.prefix_key)
            return min(self.cache[req.prefix_key], req.prompt - 1)
        return 0

    def fits(self, need: int) -> bool:
        """Room for `need` KV tokens, evicting least recently used cached prefixes if that makes it."""
        budget = self.profile.kv_tokens
        while self.reserved + self.cache_tokens + need > budget and self.cache:
            _, tokens = self.cache.popitem(last=False)
            self.cache_tokens -= tokens
        return self.reserved + self.cache_tokens + need <= budget

    def remember(self, req: SimRequest) -> None:
        if req.prefix_key and req.prefix_key not in self.cache and req.prefix_len <= self.profile.kv_tokens:
            self.cache[req.prefix_key] = req.prefix_len
            self.cache_tokens += req.prefix_len


class Node:
    def __init__(
        self,
        *,
        env: simpy.Environment,
        node_id: int,
        location: int,
        shape: NodeShape,
        board: Board,
        on_first_token: Callable[[SimRequest, float], None],
        on_finish: Callable[[SimRequest, float], None],
        cpu: Dedicated | SharedHost,
    ) -> None:
        self.env, self.node_id, self.location, self.shape = env, node_id, location, shape
        self.board, self.cpu = board, cpu
        self.name = f"n{node_id}"
        self.on_first_token, self.on_finish = on_first_token, on_finish
        self.slots: dict[int, ModelSlot] = {}
        self.busy_s = 0.0
        self.queue_depth = 0
        self.num_running = 0
        self.warm_set: frozenset[int] = frozenset()
        self.loading_set: frozenset[int] = frozenset()
        # Set whenever anything a NodeState reports changes: the fleet rebuilds its state only then.
        self.changed = True
        self._wake: simpy.Event | None = None
        env.process(self._loop())

    # ---- state the policies read -----------------------------------------------------------------
    def warm(self, model: int) -> bool:
        return model in self.warm_set

    def kv_usage(self) -> float:
        """The fullest resident model's KV pool, as a node's NodeStatus reports it."""
        return max((s.reserved / s.profile.kv_tokens for s in self.slots.values()), default=0.0)

    @property
    def capacity(self) -> int:
        """Sequence slots of all resident models, as a node's NodeStatus reports it."""
        return self.shape.max_batch * max(1, len(self.slots))

    def _residency_changed(self) -> None:
        now = self.env.now
        self.warm_set = frozenset(m for m, s in self.slots.items() if s.ready_at <= now)
        self.loading_set = frozenset(self.slots) - self.warm_set
        for m in range(self.board.warm.shape[0]):
            self.board.warm[m, self.node_id] = m in self.warm_set
        self.board.capacity[self.node_id] = self.capacity
        self.changed = True

    @property
    def saturated(self) -> bool:
        return self.queue_depth >= self.shape.busy_queue

    # ---- placement -------------------------------------------------------------------------------
    def can_host(self, profile: ModelProfile) -> bool:
        return profile.memory_gb <= self.shape.memory_gb

    def ensure_model(self, model: int, profile: ModelProfile, preload: bool = False) -> bool:
        """Make `model` resident (now if `preload`, else after its cold-load time), evicting idle models."""
        if model in self.slots:
            return True
        free = self.shape.memory_gb - sum(s.profile.memory_gb for s in self.slots.values())
        idle = sorted((s for s in self.slots.values() if not s.waiting and not s.running), key=_lru)
        evicted = False
        while free < profile.memory_gb and idle:
            victim = idle.pop(0)
            del self.slots[victim.model]
            free += victim.profile.memory_gb
            evicted = True
        if free < profile.memory_gb:
            if evicted:
                self._residency_changed()
            return False
        load_s = 0.0 if preload else profile.load_s
        slot = ModelSlot(model, profile, self.env.now + load_s)
        self.slots[model] = slot
        if load_s:
            self.env.timeout(load_s).callbacks.append(lambda _: self._loaded(slot))
        self._residency_changed()
        return True

    def _loaded(self, slot: ModelSlot) -> None:
        if self.slots.get(slot.model) is slot:
            self._residency_changed()
            self._poke()

    # ---- requests --------------------------------------------------------------------------------
    def submit(self, req: SimRequest, profile: ModelProfile) -> bool:
        """Queue `req`; False (a 429) when saturated or the model cannot be made resident."""
        if self.saturated or req.prompt + req.output > profile.kv_tokens:
            return False
        if not self.ensure_model(req.model, profile):
            return False
        slot = self.slots[req.model]
        slot.waiting.append(req)
        self.queue_depth += 1
        self.changed = True
        self.board.in_flight[self.node_id] += 1
        self.board.saturated[self.node_id] = self.saturated
        if slot.ready_at <= self.env.now and len(slot.running) < self.shape.max_batch:
            self._poke()
        return True

    def _poke(self) -> None:
        if self._wake is not None and not self._wake.triggered:
            self._wake.succeed()

    # ---- the step loop ---------------------------------------------------------------------------
    def _loop(self):
        while True:
            admitted = self._admit()
            if admitted:
                yield from self._prefill(admitted)
            elif self.num_running:
                yield from self._decode()
            else:
                self._wake = self.env.event()
                yield self._wake

    def _admit(self) -> list[tuple[ModelSlot, SimRequest]]:
        now, budget = self.env.now, self.shape.max_batched_tokens
        admitted: list[tuple[ModelSlot, SimRequest]] = []
        for slot in self.slots.values():
            if slot.ready_at > now:
                continue
            while slot.waiting and len(slot.running) < self.shape.max_batch:
                req = slot.waiting[0]
                cached = slot.cached_tokens(req)
                need = req.prompt + req.output - cached
                # At least one request per step, however long its prompt (it is then prefilled alone).
                if (admitted and req.prompt - cached > budget) or not slot.fits(need):
                    break
                slot.waiting.popleft()
                req.cached = cached
                slot.reserved += need
                slot.running.append(req)
                slot.last_used = now
                budget -= req.prompt - cached
                admitted.append((slot, req))
        if admitted:
            self.queue_depth -= len(admitted)
            self.num_running += len(admitted)
            self.changed = True
        self.board.saturated[self.node_id] = self.saturated
        return admitted

    def _prefill(self, admitted: list[tuple[ModelSlot, SimRequest]]):
        tokens: dict[int, int] = {}
        requests: dict[int, int] = {}
        for slot, req in admitted:
            tokens[slot.model] = tokens.get(slot.model, 0) + req.prompt - req.cached
            requests[slot.model] = requests.get(slot.model, 0) + 1
        duration = sum(self.slots[m].profile.prefill_s(n, requests[m]) for m, n in tokens.items())
        yield self.cpu.run(duration).event
        self.busy_s += duration
        self.cpu.background(tokens=len(admitted))
        now = self.env.now
        for slot, req in admitted:
            req.generated = 1
            req.context += 1
            self.on_first_token(req, now)
            if req.generated >= req.output:
                self._finish(slot, req, now)

    def _decode(self):
        busy = [s for s in self.slots.values() if s.running]
        k = min(r.output - r.generated for s in busy for r in s.running)
        step = sum(
            s.profile.step_s(len(s.running), _context(s.running) + len(s.running) * k / 2) for s in busy
        )
        job = self.cpu.run(k * step)
        self._wake = self.env.event()
        yield job.event | self._wake
        steps = k
        if not job.event.processed:
            # Woken by an arrival: finish the step in progress, then let the newcomer join.
            steps = min(k, math.floor(self.cpu.progress(job) / step) + 1)
            self.cpu.shorten(job, steps * step)
            yield job.event
        self.busy_s += steps * step
        self.cpu.background(tokens=steps * sum(len(s.running) for s in busy))
        now = self.env.now
        for slot in busy:
            for req in list(slot.running):
                req.generated += steps
                req.context += steps
                if req.generated >= req.output:
                    self._finish(slot, req, now)

    def _finish(self, slot: ModelSlot, req: SimRequest, now: float) -> None:
        slot.running.remove(req)
        slot.reserved -= req.prompt + req.output - req.cached
        slot.remember(req)
        slot.last_used = now
        self.num_running -= 1
        self.changed = True
        self.board.in_flight[self.node_id] -= 1
        self.on_finish(req, now)


def _context(running: list[SimRequest]) -> int:
    return sum(r.context for r in running)


def _lru(slot: ModelSlot) -> float:
    return slot.last_used

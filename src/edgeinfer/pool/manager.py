"""The model pool: several members resident under a memory budget, loaded on demand, evicted by policy.

Invariants: at most one load per member runs at a time and every request that arrives meanwhile waits
for it; a member with leases outstanding (requests in flight, or waiting for its load) is never evicted;
pinned and upstream members are never evicted. Loads are serialized pool-wide so that two loads never
count on the same free bytes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Protocol

from edgeinfer.pool.loader import MemberLoader
from edgeinfer.pool.member import PoolMember
from edgeinfer.pool.policy import DecayingRate, ModelEvictionPolicy, ResidentView, TrafficWeightedLRU
from edgeinfer.pool.spec import UPSTREAM, MemberSpec

logger = logging.getLogger("edgeinfer.pool")


class UnknownModelError(ValueError):
    """No member or alias has this name."""


class PoolCapacityError(RuntimeError):
    """A member cannot be loaded: the budget is held by busy or pinned members, or it never fits."""


class PoolListener(Protocol):
    """Receives load and evict events (the node turns them into metrics)."""

    def on_load(self, name: str, seconds: float, memory_bytes: int) -> None: ...

    def on_evict(self, name: str, memory_bytes: int) -> None: ...


@dataclass(frozen=True)
class MemberState:
    """A member as listed by the pool (for /v1/models and status)."""

    name: str
    kind: str
    aliases: tuple[str, ...]
    state: str  # resident, loading, unloaded
    memory_bytes: int
    in_flight: int
    pinned: bool
    version: str | None


class Lease:
    """One request's hold on a member; while any lease is held the member is never evicted."""

    def __init__(self, pool: ModelPool, slot: _Slot) -> None:
        self._pool = pool
        self._slot = slot
        self._released = False
        self.member: PoolMember

    @property
    def name(self) -> str:
        return self._slot.spec.name

    def release(self) -> None:
        """Synchronous and idempotent, so it is safe in cleanup code that runs under cancellation."""
        if not self._released:
            self._released = True
            self._pool._release(self._slot)


@dataclass
class _Slot:
    spec: MemberSpec
    rate: DecayingRate
    member: PoolMember | None = None
    load_task: asyncio.Task[PoolMember] | None = None
    known_bytes: int | None = None
    in_flight: int = 0
    waiting_for_load: int = 0
    last_used: float = 0.0
    task: str | None = None

    @property
    def pinned(self) -> bool:
        return self.spec.pinned or self.spec.kind == UPSTREAM


class ModelPool:
    """Leases members to requests: `async with pool.lease(name) as member: ...`."""

    def __init__(
        self,
        specs: Iterable[MemberSpec],
        loader: MemberLoader,
        budget_bytes: int | None = None,
        policy: ModelEvictionPolicy | None = None,
        listener: PoolListener | None = None,
        clock: Callable[[], float] = time.monotonic,
        rate_half_life_s: float = 60.0,
    ) -> None:
        self._loader = loader
        self.budget_bytes = budget_bytes
        self._policy = policy or TrafficWeightedLRU()
        self._listeners: list[PoolListener] = [listener] if listener is not None else []
        self._clock = clock
        self._slots: dict[str, _Slot] = {}
        self._names: dict[str, str] = {}
        for spec in specs:
            self._add(spec, DecayingRate(rate_half_life_s))
        if not self._slots:
            raise ValueError("the pool needs at least one model (--model or --upstream)")
        self._load_lock = asyncio.Lock()

    def _add(self, spec: MemberSpec, rate: DecayingRate) -> None:
        for name in (spec.name, *spec.aliases):
            if name in self._names:
                raise ValueError(f"model name {name!r} is registered twice")
            self._names[name] = spec.name
        self._slots[spec.name] = _Slot(spec=spec, rate=rate)

    def add_listener(self, listener: PoolListener) -> None:
        self._listeners.append(listener)

    def resolve(self, name: str) -> str:
        """The canonical name for `name` or an alias; UnknownModelError otherwise."""
        try:
            return self._names[name]
        except KeyError:
            known = ", ".join(sorted(self._names))
            raise UnknownModelError(f"model {name!r} does not exist; this node serves: {known}") from None

    def spec(self, name: str) -> MemberSpec:
        return self._slots[self.resolve(name)].spec

    def names(self) -> dict[str, str]:
        """Every name a request may use (canonical names and aliases) → its canonical name."""
        return dict(self._names)

    def task(self, name: str) -> str:
        """What a member serves (generate or embed), known before it loads; asked once, then kept."""
        slot = self._slots[self.resolve(name)]
        if slot.task is None:
            slot.task = self._loader.task(slot.spec)
        return slot.task

    def residents(self) -> dict[str, PoolMember]:
        return {name: slot.member for name, slot in self._slots.items() if slot.member is not None}

    def in_flight(self, name: str) -> int:
        return self._slots[self.resolve(name)].in_flight

    def waiting_for_load(self, name: str) -> int:
        return self._slots[self.resolve(name)].waiting_for_load

    def used_bytes(self) -> int:
        return sum(slot.known_bytes or 0 for slot in self._slots.values() if slot.member is not None)

    def states(self) -> list[MemberState]:
        return [self._state(slot) for slot in self._slots.values()]

    async def acquire(self, name: str) -> Lease:
        """Hold a member for one request, loading it first when needed; `release()` the lease after."""
        slot = self._slots[self.resolve(name)]
        slot.in_flight += 1
        slot.rate.hit(self._clock())
        lease = Lease(self, slot)
        try:
            lease.member = slot.member or await self._wait_for_load(slot)
        except BaseException:
            lease.release()
            raise
        return lease

    @asynccontextmanager
    async def lease(self, name: str) -> AsyncIterator[PoolMember]:
        """`async with pool.lease(name) as member:` — acquire and release around a block."""
        lease = await self.acquire(name)
        try:
            yield lease.member
        finally:
            lease.release()

    def is_resident(self, name: str) -> bool:
        return self._slots[self.resolve(name)].member is not None

    def prefetch(self, name: str) -> None:
        """Start loading a member in the background (no-op when resident or already loading)."""
        slot = self._slots[self.resolve(name)]
        if slot.member is None:
            self._start_load(slot)

    def _release(self, slot: _Slot) -> None:
        slot.in_flight -= 1
        slot.last_used = self._clock()

    async def preload(self, names: Iterable[str]) -> None:
        """Load members at start-up, in order."""
        for name in names:
            async with self.lease(name):
                pass

    async def shutdown(self) -> None:
        """Stop loads in progress and close every resident member."""
        for slot in self._slots.values():
            if slot.load_task is not None:
                slot.load_task.cancel()
        for slot in self._slots.values():
            member, slot.member = slot.member, None
            if member is not None:
                await member.close()

    def _start_load(self, slot: _Slot) -> asyncio.Task[PoolMember]:
        if slot.load_task is None:
            slot.load_task = asyncio.create_task(self._load(slot), name=f"load:{slot.spec.name}")
            # Every waiter may have gone away; retrieving the outcome here avoids a "never retrieved" warning.
            slot.load_task.add_done_callback(lambda task: task.cancelled() or task.exception())
        return slot.load_task

    async def _wait_for_load(self, slot: _Slot) -> PoolMember:
        task = self._start_load(slot)
        slot.waiting_for_load += 1
        try:
            # shield: a waiter whose client went away must not cancel the load the others wait for.
            return await asyncio.shield(task)
        finally:
            slot.waiting_for_load -= 1

    async def _load(self, slot: _Slot) -> PoolMember:
        name = slot.spec.name
        try:
            async with self._load_lock:
                if slot.member is not None:
                    return slot.member
                need = slot.known_bytes
                if need is None:
                    need = await asyncio.to_thread(self._loader.estimate_bytes, slot.spec)
                await self._make_room(slot, need)
                logger.info("loading model %s (%s, ~%d bytes)", name, slot.spec.target, need)
                started = self._clock()
                member = await self._loader.load(slot.spec)
                seconds = self._clock() - started
                slot.member, slot.known_bytes = member, member.memory_bytes()
                slot.last_used = self._clock()
                logger.info("loaded model %s in %.2f s, %d bytes resident", name, seconds, slot.known_bytes)
                for listener in self._listeners:
                    listener.on_load(name, seconds, slot.known_bytes)
                await self._shrink_to_budget(slot)
                return member
        finally:
            slot.load_task = None

    async def _make_room(self, slot: _Slot, need: int) -> None:
        if self.budget_bytes is None or need <= 0:
            return
        if need > self.budget_bytes:
            raise PoolCapacityError(
                f"model {slot.spec.name} needs ~{need} bytes, "
                f"more than the pool budget of {self.budget_bytes}"
            )
        shortfall = need - (self.budget_bytes - self.used_bytes())
        victims = self._policy.choose_victims(self._views(exclude=slot), shortfall)
        if victims is None:
            raise PoolCapacityError(
                f"no room for model {slot.spec.name} (~{need} bytes): the budget of "
                f"{self.budget_bytes} bytes is held by models that are busy or pinned; retry shortly"
            )
        for victim in victims:
            await self._evict(self._slots[victim])

    async def _shrink_to_budget(self, loaded: _Slot) -> None:
        """The estimate can undershoot (dequantized weights): evict idle members to get back under."""
        if self.budget_bytes is None:
            return
        excess = self.used_bytes() - self.budget_bytes
        victims = self._policy.choose_victims(self._views(exclude=loaded), excess) if excess > 0 else []
        for victim in victims or []:
            await self._evict(self._slots[victim])
        if self.used_bytes() > self.budget_bytes:
            logger.warning(
                "pool over budget after loading %s: %d of %d bytes (busy or pinned members hold the rest)",
                loaded.spec.name,
                self.used_bytes(),
                self.budget_bytes,
            )

    async def _evict(self, slot: _Slot) -> None:
        # Detach before the await: a request arriving while the engine shuts down must trigger a
        # fresh load, never get the closing engine.
        member, slot.member = slot.member, None
        if member is None:
            return
        freed = slot.known_bytes or 0
        logger.info("evicting model %s (%d bytes, idle %.1f s)", slot.spec.name, freed, self._idle(slot))
        await member.close()
        for listener in self._listeners:
            listener.on_evict(slot.spec.name, freed)

    def _views(self, exclude: _Slot) -> list[ResidentView]:
        now = self._clock()
        return [
            ResidentView(
                name=slot.spec.name,
                memory_bytes=slot.known_bytes or 0,
                idle_s=self._idle(slot),
                recent_requests=slot.rate.value(now),
                in_flight=slot.in_flight,
                pinned=slot.pinned,
            )
            for slot in self._slots.values()
            if slot is not exclude and slot.member is not None
        ]

    def _idle(self, slot: _Slot) -> float:
        return 0.0 if slot.in_flight else max(0.0, self._clock() - slot.last_used)

    def _state(self, slot: _Slot) -> MemberState:
        if slot.member is not None:
            state = "resident"
        elif slot.load_task is not None:
            state = "loading"
        else:
            state = "unloaded"
        return MemberState(
            name=slot.spec.name,
            kind=slot.spec.kind,
            aliases=slot.spec.aliases,
            state=state,
            memory_bytes=slot.member.memory_bytes() if slot.member is not None else 0,
            in_flight=slot.in_flight,
            pinned=slot.pinned,
            version=slot.member.version if slot.member is not None else None,
        )

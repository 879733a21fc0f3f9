"""A router's share of one tenant's budget: taken from the bucket a slice at a time, spent locally, given
back once idle; and the per-router counts that stand in for the bucket while it is unreachable."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from edgeinfer.router.limits.store import change, give_units, slots_edit, take_units


@dataclass(kw_only=True)
class WindowLease:
    """Units of one rate limit (requests or tokens) this router holds in the current window. `name` is
    the bucket key's stem; each window has its own key, so a new window starts from nothing."""

    name: str
    limit: int
    slice: int
    recheck_s: float
    held: int = 0
    window: int = -1
    last_used: float = 0.0
    # Once the bucket had too little, it is asked again only after `recheck_s` (what other routers hold
    # comes back when idle): a tenant flooding past its limit costs the bucket nothing more.
    spent_until: float = 0.0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def key(self, window: int) -> str:
        return f"{self.name}.{window}"

    async def take(self, kv: Any, amount: int, window: int, now: float) -> bool:
        """Spend `amount` units of `window`, taking a slice (or what is left) from the bucket where what
        this router holds falls short. False: the fleet's budget for the window does not hold it."""
        async with self.lock:
            self._roll(window)
            if self.held < amount and now >= self.spent_until:
                want = max(amount - self.held, self.slice)
                granted = await change(kv, self.key(window), take_units(want, self.limit))
                self.held += granted
                if self.held < amount:
                    self.spent_until = now + self.recheck_s
            self.last_used = now
            if self.held < amount:
                return False
            self.held -= amount
            return True

    def put_back(self, amount: int, window: int) -> None:
        """Units spent in `window` but not used after all (a refused request, a reservation larger than
        the use); a past window's are gone with it."""
        if window == self.window and amount > 0:
            self.held += amount

    def spend(self, amount: int, window: int) -> int:
        """Spend up to `amount` held units of `window`; returns what they did not cover."""
        if window != self.window:
            return 0
        covered = min(self.held, amount)
        self.held -= covered
        return amount - covered

    async def force(self, kv: Any, amount: int, window: int) -> None:
        """Count `amount` more units in the bucket, over the limit if need be (tokens used beyond their
        reservation: they were used)."""
        await change(kv, self.key(window), take_units(amount, self.limit, force=True))

    async def return_idle(self, kv: Any, window: int, now: float, idle_s: float) -> None:
        """Give what this router holds back to the bucket once it has sat unused `idle_s`."""
        async with self.lock:
            self._roll(window)
            if self.held and now - self.last_used >= idle_s:
                units, self.held = self.held, 0
                await change(kv, self.key(window), give_units(units))

    async def give_back(self, kv: Any) -> None:
        """Everything held goes back to the bucket now (the router stops)."""
        async with self.lock:
            if self.held:
                units, self.held = self.held, 0
                await change(kv, self.key(self.window), give_units(units))

    def _roll(self, window: int) -> None:
        if window != self.window:
            self.window, self.held, self.spent_until = window, 0, 0.0


@dataclass(kw_only=True)
class SlotLease:
    """Concurrency slots of one tenant this router holds: `in_use` by its running requests, `free` ready
    for the next ones. The bucket's slot table counts both under this router's name."""

    key: str
    router: str
    limit: int
    slice: int
    ttl_s: float
    free: int = 0
    in_use: int = 0
    last_used: float = 0.0
    refreshed: float = 0.0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    async def acquire(self, kv: Any, now: float) -> bool:
        async with self.lock:
            if not self.free:
                edit = slots_edit(self.router, self.slice, self.limit, now, self.ttl_s)
                granted = await change(kv, self.key, edit)
                self.free += granted
                self.refreshed = now
            if not self.free:
                return False
            self.free -= 1
            self.in_use += 1
            self.last_used = now
            return True

    async def give_back(self, kv: Any, now: float) -> None:
        """Every slot this router holds goes back now (the router stops: its streams end with it)."""
        async with self.lock:
            if self.free + self.in_use:
                units, self.free, self.in_use = self.free + self.in_use, 0, 0
                await change(kv, self.key, slots_edit(self.router, -units, self.limit, now, self.ttl_s))

    def release(self, now: float) -> None:
        self.in_use -= 1
        self.free += 1
        self.last_used = now

    async def maintain(self, kv: Any, now: float, idle_s: float) -> None:
        """Give idle free slots back; keep the expiry of held ones ahead (a router that stops keeping it
        ahead, a dead one, loses them when it passes)."""
        async with self.lock:
            if self.free and now - self.last_used >= idle_s:
                units, self.free = self.free, 0
                await change(kv, self.key, slots_edit(self.router, -units, self.limit, now, self.ttl_s))
                self.refreshed = now
            elif self.in_use + self.free and now - self.refreshed >= self.ttl_s / 3:
                await change(kv, self.key, slots_edit(self.router, 0, self.limit, now, self.ttl_s))
                self.refreshed = now


@dataclass(kw_only=True)
class LocalWindow:
    """One router's own count of a rate limit in a window: the limit per router while the bucket is out."""

    limit: int
    used: int = 0
    window: int = -1

    def take(self, amount: int, window: int) -> bool:
        if window != self.window:
            self.window, self.used = window, 0
        if self.used + amount > self.limit:
            return False
        self.used += amount
        return True

    def put_back(self, amount: int, window: int) -> None:
        if window == self.window:
            self.used = max(0, self.used - amount)

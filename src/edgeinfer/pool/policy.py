"""Which resident models to evict when a load needs memory. Pure policy: no torch, no I/O."""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass


class DecayingRate:
    """A request counter whose past hits fade with a half-life: a smooth 'recent traffic' number.

    `value(now)` is the sum over past hits of 2^-(age / half_life); a steady stream of r requests per
    second settles at r * half_life / ln 2.
    """

    def __init__(self, half_life_s: float = 60.0) -> None:
        if half_life_s <= 0:
            raise ValueError("half_life_s must be > 0")
        self._half_life = half_life_s
        self._value = 0.0
        self._at = 0.0

    def hit(self, now: float, count: float = 1.0) -> None:
        self._value = self.value(now) + count
        self._at = now

    def value(self, now: float) -> float:
        age = max(0.0, now - self._at)
        return self._value * math.pow(2.0, -age / self._half_life)

    def per_minute(self, now: float) -> float:
        """The steady request rate that would give the current value."""
        return self.value(now) * math.log(2.0) / self._half_life * 60.0


@dataclass(frozen=True)
class ResidentView:
    """What the policy may know about one resident model."""

    name: str
    memory_bytes: int
    idle_s: float
    recent_requests: float
    in_flight: int
    pinned: bool

    @property
    def evictable(self) -> bool:
        # A model with requests in flight is never evicted: its engine holds their KV blocks and streams.
        return not self.pinned and self.in_flight == 0 and self.memory_bytes > 0


class ModelEvictionPolicy(abc.ABC):
    """Chooses victims among resident models; returns None when no choice frees enough."""

    @abc.abstractmethod
    def choose_victims(self, residents: list[ResidentView], bytes_needed: int) -> list[str] | None: ...


class TrafficWeightedLRU(ModelEvictionPolicy):
    """LRU where recent traffic buys a model time: evict the largest `idle_s / (1 + recent_requests)`.

    A model idle 60 s that saw 30 recent requests scores ~1.9 and outlives one idle 10 s that saw none
    (score 10). Victims are taken in score order until enough bytes are freed.
    """

    def choose_victims(self, residents: list[ResidentView], bytes_needed: int) -> list[str] | None:
        if bytes_needed <= 0:
            return []
        candidates = sorted(
            (r for r in residents if r.evictable),
            key=lambda r: (-self.score(r), r.name),
        )
        victims: list[str] = []
        freed = 0
        for resident in candidates:
            if freed >= bytes_needed:
                break
            victims.append(resident.name)
            freed += resident.memory_bytes
        return victims if freed >= bytes_needed else None

    @staticmethod
    def score(resident: ResidentView) -> float:
        return resident.idle_s / (1.0 + resident.recent_requests)

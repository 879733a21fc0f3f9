"""A circuit breaker per node: closed → open after repeated failures → half-open (one probe) → closed.

Failures are what a retry elsewhere answers: connection errors, timeouts and 5xx. A 429 is the node
working as designed (busy), never a failure. While open, the node counts as unavailable to the policy;
after `reset_after_s` the next request is let through as the single probe, whose outcome closes or
re-opens the breaker.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable


class BreakerState(enum.StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


CLOSED, OPEN, HALF_OPEN = BreakerState.CLOSED, BreakerState.OPEN, BreakerState.HALF_OPEN
STATE_VALUES = {CLOSED: 0, HALF_OPEN: 1, OPEN: 2}  # the gauge's values


class CircuitBreaker:
    def __init__(
        self,
        failure_threshold: int = 3,
        reset_after_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.failure_threshold = failure_threshold
        self.reset_after_s = reset_after_s
        self._clock = clock
        self.state: BreakerState = CLOSED
        self._failures = 0
        self._opened_at = 0.0
        self._probing = False

    def available(self) -> bool:
        """Whether a request may go to the node now (does not change the state)."""
        if self.state == CLOSED:
            return True
        if self.state == OPEN:
            return self._clock() - self._opened_at >= self.reset_after_s
        return not self._probing

    def acquire(self) -> bool:
        """Claim a request slot: False while open; in half-open, only one probe at a time."""
        if not self.available():
            return False
        if self.state != CLOSED:
            self.state = HALF_OPEN
            self._probing = True
        return True

    def success(self) -> None:
        self.state = CLOSED
        self._failures = 0
        self._probing = False

    def failure(self) -> None:
        self._failures += 1
        if self.state == HALF_OPEN or self._failures >= self.failure_threshold:
            self.state = OPEN
            self._opened_at = self._clock()
        self._probing = False

    def release(self) -> None:
        """The request ended without telling anything about the node (the client left)."""
        self._probing = False

"""Per-model admission at the node: the engine's seats and waiting queue, checked and reserved in one step.

A request reaches its engine only after awaits (leasing the model, tokenizing on the way), so the engine's
own counts cannot decide admission: a burst of simultaneous requests would all see the same free room.
The node therefore counts what it admitted per model itself, synchronously on the event loop.
"""

from __future__ import annotations

from edgeinfer.api.errors import busy


class Reservation:
    """Engine requests (choices) held by one admitted request until `release` (idempotent)."""

    def __init__(self, counts: dict[str, int], model: str, choices: int) -> None:
        self._counts = counts
        self._model = model
        self._choices = choices
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._counts[self._model] -= self._choices


class Capacity:
    """Engine requests admitted per model and not yet finished, running or waiting."""

    def __init__(self, max_queue_depth: int) -> None:
        self.max_queue_depth = max_queue_depth
        self._counts: dict[str, int] = {}

    def admitted(self, model: str) -> int:
        return self._counts.get(model, 0)

    def reserve(
        self, model: str, choices: int, seats: int | None, engine_waiting: int, reject_if_busy: bool
    ) -> Reservation:
        """Admit `choices` engine requests or raise 429 (code 3040). `seats`: how many the model runs at
        once (None: unknown, an upstream that queues on its own: then its own queue is the only view).
        `engine_waiting`: requests the engine itself holds back (short of KV blocks, or an upstream's
        queue as its metrics show it) — the queue is the longer of the two views."""
        admitted = self.admitted(model)
        waiting = engine_waiting if seats is None else max(admitted - seats, engine_waiting)
        full_now = engine_waiting > 0 or (seats is not None and admitted + choices > seats)
        if reject_if_busy and full_now:
            raise busy(f"model {model} is busy and the request asked not to wait (rejectIfBusy)")
        if waiting >= self.max_queue_depth:
            raise busy(f"model {model} queue is full ({self.max_queue_depth} requests waiting)")
        self._counts[model] = admitted + choices
        return Reservation(self._counts, model, choices)

"""Forward-pass batching for embedding requests: a micro-batch window and a token budget. No torch.

Every input of every request is one item. Items wait until the oldest has waited `window_s` (so that
the many small requests of a page load share one forward pass) or until enough are queued to fill a
batch; a batch then takes items in arrival order while `max_batch_tokens` and `max_batch_size` last.
A request's inputs may be split across batches; at least one item always goes, so a lone input at
the maximum length is never stuck.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class EmbedItem:
    """Input `index` of request `request_id`, `num_tokens` long."""

    request_id: str
    index: int
    num_tokens: int
    arrival: float


class EmbedBatcher:
    def __init__(self, max_batch_tokens: int, max_batch_size: int, window_s: float) -> None:
        if max_batch_tokens < 1 or max_batch_size < 1 or window_s < 0:
            raise ValueError("max_batch_tokens and max_batch_size must be >= 1, window_s >= 0")
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_size = max_batch_size
        self.window_s = window_s
        self._queue: deque[EmbedItem] = deque()
        self._queued_tokens = 0

    def __len__(self) -> int:
        return len(self._queue)

    def add(self, items: list[EmbedItem]) -> None:
        self._queue.extend(items)
        self._queued_tokens += sum(item.num_tokens for item in items)

    def drop(self, request_id: str) -> None:
        """Forget a request's queued items (its caller went away)."""
        kept = [item for item in self._queue if item.request_id != request_id]
        self._queued_tokens = sum(item.num_tokens for item in kept)
        self._queue = deque(kept)

    def ready_at(self) -> float | None:
        """When the next batch may go: the oldest item's window end; -inf when a batch is full already;
        None when nothing waits."""
        if not self._queue:
            return None
        if self._queued_tokens >= self.max_batch_tokens or len(self._queue) >= self.max_batch_size:
            return float("-inf")
        return self._queue[0].arrival + self.window_s

    def take(self) -> list[EmbedItem]:
        """The next batch, oldest items first."""
        batch: list[EmbedItem] = []
        tokens = 0
        while self._queue and len(batch) < self.max_batch_size:
            item = self._queue[0]
            if batch and tokens + item.num_tokens > self.max_batch_tokens:
                break
            batch.append(self._queue.popleft())
            tokens += item.num_tokens
        self._queued_tokens -= tokens
        return batch

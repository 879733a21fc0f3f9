"""The batch queue's settings (without NATS's client: a node that is not on NATS never loads it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class BatchSettings:
    """Shared by the fleet: the first node or router to create the stream and buckets sets them."""

    retention_s: float = 24 * 3600.0  # a batch and its results are kept this long after submission
    ack_wait_s: float = 30.0  # an entry whose node said nothing this long goes to another node
    max_attempts: int = 5  # deliveries of an entry before it is answered with an error

    def __post_init__(self) -> None:
        if not (self.retention_s > 0 and self.ack_wait_s > 0 and self.max_attempts >= 1):
            raise ValueError("batch retention and ack wait must be > 0, attempts >= 1")

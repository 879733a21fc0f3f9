"""Waiting queues: FCFS and priority (lower value first, then arrival); in both, every interactive request
before any batch one (types.request.Lane)."""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterator
from enum import StrEnum

from edgeinfer.engine.scheduler.request import Request


class WaitingQueue(ABC):
    @abstractmethod
    def push(self, req: Request) -> None: ...

    @abstractmethod
    def push_front(self, req: Request) -> None:
        """Re-queue a preempted request ahead of newer arrivals."""

    @abstractmethod
    def peek(self) -> Request: ...

    @abstractmethod
    def pop(self) -> Request: ...

    @abstractmethod
    def remove(self, request_id: str) -> Request | None: ...

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Request]: ...

    @property
    @abstractmethod
    def num_batch(self) -> int:
        """Batch-lane requests waiting; read without the engine's lock, so a counter, never a walk."""


class FCFSQueue(WaitingQueue):
    """Arrival order within each lane, the interactive lane first."""

    def __init__(self) -> None:
        self._interactive: deque[Request] = deque()
        self._batch: deque[Request] = deque()

    def _lane(self, req: Request) -> deque[Request]:
        return self._batch if req.is_batch else self._interactive

    def push(self, req: Request) -> None:
        self._lane(req).append(req)

    def push_front(self, req: Request) -> None:
        self._lane(req).appendleft(req)

    def peek(self) -> Request:
        return (self._interactive or self._batch)[0]

    def pop(self) -> Request:
        return (self._interactive or self._batch).popleft()

    def remove(self, request_id: str) -> Request | None:
        for lane in (self._interactive, self._batch):
            for req in lane:
                if req.request_id == request_id:
                    lane.remove(req)
                    return req
        return None

    def __len__(self) -> int:
        return len(self._interactive) + len(self._batch)

    def __iter__(self) -> Iterator[Request]:
        return itertools.chain(self._interactive, self._batch)

    @property
    def num_batch(self) -> int:
        return len(self._batch)


class PriorityQueue(WaitingQueue):
    """Ordered by (lane, priority, arrival); a preempted request keeps its original place."""

    def __init__(self) -> None:
        self._heap: list[tuple[bool, int, float, int, Request]] = []
        self._seq = itertools.count()
        self._num_batch = 0

    def push(self, req: Request) -> None:
        heapq.heappush(self._heap, (req.is_batch, req.priority, req.arrival_time, next(self._seq), req))
        self._num_batch += req.is_batch

    push_front = push

    def peek(self) -> Request:
        return self._heap[0][-1]

    def pop(self) -> Request:
        req = heapq.heappop(self._heap)[-1]
        self._num_batch -= req.is_batch
        return req

    def remove(self, request_id: str) -> Request | None:
        for i, item in enumerate(self._heap):
            if item[-1].request_id == request_id:
                self._heap.pop(i)
                heapq.heapify(self._heap)
                self._num_batch -= item[-1].is_batch
                return item[-1]
        return None

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (item[-1] for item in sorted(self._heap))

    @property
    def num_batch(self) -> int:
        return self._num_batch


class SchedulingPolicy(StrEnum):
    """FCFS: arrival order. PRIORITY: a request's `priority` first (lower first), then arrival; it also picks
    preemption victims and orders prefill across tenants."""

    FCFS = "fcfs"
    PRIORITY = "priority"

    @property
    def by_priority(self) -> bool:
        return self is SchedulingPolicy.PRIORITY

    def queue(self) -> WaitingQueue:
        return PriorityQueue() if self.by_priority else FCFSQueue()

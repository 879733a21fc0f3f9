"""Waiting queues: FCFS and priority (lower value first, then arrival)."""

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


class FCFSQueue(WaitingQueue):
    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def push(self, req: Request) -> None:
        self._q.append(req)

    def push_front(self, req: Request) -> None:
        self._q.appendleft(req)

    def peek(self) -> Request:
        return self._q[0]

    def pop(self) -> Request:
        return self._q.popleft()

    def remove(self, request_id: str) -> Request | None:
        for req in self._q:
            if req.request_id == request_id:
                self._q.remove(req)
                return req
        return None

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)


class PriorityQueue(WaitingQueue):
    """Ordered by (priority, arrival); a preempted request keeps its original place."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._seq = itertools.count()

    def push(self, req: Request) -> None:
        heapq.heappush(self._heap, (req.priority, req.arrival_time, next(self._seq), req))

    push_front = push

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, request_id: str) -> Request | None:
        for i, item in enumerate(self._heap):
            if item[3].request_id == request_id:
                self._heap.pop(i)
                heapq.heapify(self._heap)
                return item[3]
        return None

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (item[3] for item in sorted(self._heap))


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

"""Request state machine, admission, token budget, preemption and fairness. No torch."""

from edgeinfer.engine.scheduler.output import ScheduledChunk, SchedulerOutput
from edgeinfer.engine.scheduler.queue import SchedulingPolicy
from edgeinfer.engine.scheduler.request import Request, RequestStatus
from edgeinfer.engine.scheduler.scheduler import Scheduler, SchedulerConfig

__all__ = [
    "Request",
    "RequestStatus",
    "ScheduledChunk",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "SchedulingPolicy",
]

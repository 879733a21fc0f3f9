"""Small dependency-free dataclasses that cross rooms."""

from edgeinfer.types.request import EngineRequest, FinishReason, RequestOutput, Timeline, TokenLogprob, Usage
from edgeinfer.types.sampling import SamplingParams
from edgeinfer.types.status import NodeStatus

__all__ = [
    "EngineRequest",
    "FinishReason",
    "NodeStatus",
    "RequestOutput",
    "SamplingParams",
    "Timeline",
    "TokenLogprob",
    "Usage",
]

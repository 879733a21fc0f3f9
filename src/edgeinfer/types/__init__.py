"""Small dependency-free dataclasses that cross rooms."""

from edgeinfer.types.request import EngineRequest, FinishReason, RequestOutput, Timeline, TokenLogprob, Usage
from edgeinfer.types.sampling import SamplingParams

__all__ = [
    "EngineRequest",
    "FinishReason",
    "RequestOutput",
    "SamplingParams",
    "Timeline",
    "TokenLogprob",
    "Usage",
]

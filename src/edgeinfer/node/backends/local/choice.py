"""One choice's progress while its engine stream is merged with the others'."""

from __future__ import annotations

from dataclasses import dataclass, field

from edgeinfer.structured.stream import AnswerParser
from edgeinfer.types import EngineRequest, Usage


@dataclass(kw_only=True)
class Choice:
    """Per-choice progress while merging engine streams."""

    request: EngineRequest
    prompt_text: str
    echoed: bool = False
    finished: bool = False
    last_token_at: float | None = None
    usage: Usage | None = None  # cumulative, from the latest engine output
    token_ids: list[int] = field(default_factory=list)
    parser: AnswerParser | None = None  # chat answers: reasoning / content / tool calls
    num_calls: int = 0

    def take_usage(self, usage: Usage) -> None:
        """The engine's own count, given when the stream closed before its end."""
        self.usage = usage

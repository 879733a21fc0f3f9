"""A chat answer's text split as it streams into reasoning, content and tool calls (structured/)."""

from __future__ import annotations

from typing import Any

from edgeinfer.api.jobs import CHAT, Job
from edgeinfer.node.backends.base import ChoiceDelta
from edgeinfer.node.backends.local.choice import Choice
from edgeinfer.structured.stream import THINK_OPEN, AnswerParser, Parts


def answer_parser(job: Job, tok: Any, prompt: str) -> AnswerParser | None:
    """A parser for chat answers that may hold tool calls or reasoning; None where text passes as it is."""
    if job.kind != CHAT or not (job.tools or tok.reasons):
        return None
    opened = tok.reasons and prompt.rstrip().endswith(THINK_OPEN)  # the template opened the block
    return AnswerParser(tok.tool_format if job.tools else None, tok.reasons, in_reasoning=opened)


def parse_answer(choice: Choice, index: int, text: str, finished: bool) -> ChoiceDelta:
    """The delta of `text`; at the answer's end (or a repeated call) whatever the parser still held."""
    if choice.parser is None:
        return ChoiceDelta(index, text)
    parts = choice.parser.feed(text)
    if finished or choice.parser.repeated:
        end = choice.parser.finish()
        calls = parts.tool_calls + end.tool_calls
        parts = Parts(parts.reasoning + end.reasoning, parts.content + end.content, calls)
    calls = parts.tool_calls
    choice.num_calls += len({item["index"] for item in calls if "id" in item})
    return ChoiceDelta(index, parts.content, reasoning=parts.reasoning, tool_calls=calls or None)

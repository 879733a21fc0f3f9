"""Splitting a chat answer, as it streams, into reasoning, content and tool calls.

Reasoning is a leading `<think>...</think>` block (families in THINKING_FORMATS; the prompt may already
have opened it). Content streams until a tool-call opener appears (a suffix that could be the start of
one is held back); from there on the text is read for calls as it comes (call_stream.py), which stream as
OpenAI `tool_calls` deltas. For the JSON forms the answer is a call only if it is one JSON document, so an
answer starting with `{` is read as calls. Text in which no call appears is released as content at the end.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from edgeinfer.structured.call_scan import partial_suffix
from edgeinfer.structured.call_stream import CallStream
from edgeinfer.structured.formats import ToolFormat

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass
class Parts:
    """What one step of text turned into; `tool_calls` are OpenAI stream delta items (with `index`)."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


class AnswerParser:
    """Feed text deltas; `finish()` once at the end. `tools` None: content is never parsed for calls."""

    def __init__(self, tools: ToolFormat | None, reasoning: bool, in_reasoning: bool = False) -> None:
        self._tools = tools
        self._reasoning = reasoning
        self._state = "think" if in_reasoning else ("start" if reasoning else "content")
        self._buffer = ""
        self._calls_text = ""  # released as content if no call appears in it
        self._calls = CallStream(tools.scanner()) if tools is not None else None
        self._after_reasoning = False  # whitespace between `</think>` and the content is dropped

    @property
    def repeated(self) -> bool:
        """A call repeated an earlier one: the answer should end here (call_stream.py)."""
        return self._calls is not None and self._calls.repeated

    def feed(self, text: str) -> Parts:
        self._buffer += text
        parts = Parts()
        if self._state == "start":
            self._open_reasoning()
        if self._state == "think":
            self._take_reasoning(parts)
        if self._state == "content":
            parts.content += self._take_content()
        if self._state == "calls":
            parts.tool_calls = self._read_calls(self._buffer)
            self._buffer = ""
        return parts

    def finish(self) -> Parts:
        parts = Parts()
        if self._state in ("start", "think"):
            # an unclosed block: what was held back is still reasoning (or content, if it never opened)
            setattr(parts, "reasoning" if self._state == "think" else "content", self._buffer)
        else:
            parts.content = self._buffer
        self._buffer = ""
        if self._state == "calls":
            assert self._calls is not None
            parts.tool_calls = self._calls.finish()
            if not self._calls.began:
                parts.content += self._calls_text
        return parts

    def _read_calls(self, text: str) -> list[dict[str, Any]]:
        assert self._calls is not None
        if not self._calls.began:
            self._calls_text += text
        return self._calls.feed(text)

    def _open_reasoning(self) -> None:
        head = self._buffer.lstrip()
        if head.startswith(THINK_OPEN):
            self._buffer = head[len(THINK_OPEN) :]
            self._state = "think"
        elif not THINK_OPEN.startswith(head):
            self._state = "content"

    def _take_reasoning(self, parts: Parts) -> None:
        end = self._buffer.find(THINK_CLOSE)
        if end >= 0:
            parts.reasoning += self._buffer[:end]
            self._buffer = self._buffer[end + len(THINK_CLOSE) :]
            self._state, self._after_reasoning = "content", True
            return
        keep = partial_suffix(self._buffer, THINK_CLOSE)
        parts.reasoning += self._buffer[: len(self._buffer) - keep]
        self._buffer = self._buffer[len(self._buffer) - keep :]

    def _take_content(self) -> str:
        if self._after_reasoning:
            self._buffer = self._buffer.lstrip()
            self._after_reasoning = not self._buffer
        if self._tools is None:
            out, self._buffer = self._buffer, ""
            return out
        opener = self._tools.opener
        if opener is None:
            return self._take_json_content()
        start = self._buffer.find(opener)
        if start >= 0:
            out, self._buffer = self._buffer[:start].rstrip(), self._buffer[start:]
            self._state = "calls"
            return out
        # Held back: a suffix that may begin the opener, and whitespace before it (dropped if a call follows).
        ready = self._buffer[: len(self._buffer) - partial_suffix(self._buffer, opener)].rstrip()
        out, self._buffer = ready, self._buffer[len(ready) :]
        return out

    def _take_json_content(self) -> str:
        head = self._buffer.lstrip()
        if not head:
            return ""
        if head.startswith(("{", "<|python_tag|>"[: len(head)])):
            self._state = "calls"
            return ""
        self._tools = None  # plain text: the answer is not a call
        out, self._buffer = self._buffer, ""
        return out

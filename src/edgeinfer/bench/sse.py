"""Incremental parser for Server-Sent Events (the `text/event-stream` format OpenAI-style servers stream).

Network reads split the stream at arbitrary points, so the parser keeps the unfinished line between feeds. It
follows the WHATWG event-stream rules that matter to OpenAI-compatible servers: lines end in LF, CRLF or CR; a
blank line ends an event; several `data:` lines in one event are joined with LF; lines starting with `:` are
comments (keep-alives); one space after the colon is dropped; fields other than `data` and `event` are
ignored.
"""

from __future__ import annotations

from dataclasses import dataclass

DONE_SENTINEL = "[DONE]"


@dataclass(frozen=True)
class SSEEvent:
    """One dispatched event: `data` (its data lines joined with LF) and `event` ("message" if unset)."""

    data: str
    event: str = "message"


class SSEParser:
    """Feed decoded text as it arrives; get back the events it completes."""

    def __init__(self) -> None:
        self._buffer = ""
        self._data_lines: list[str] = []
        self._event_type = ""
        # A chunk may end between the CR and LF of a CRLF; remember so the LF is not read as a second line
        # end.
        self._last_was_cr = False

    def feed(self, text: str) -> list[SSEEvent]:
        """Consume `text` and return the events completed by it (possibly none)."""
        if not text:
            return []
        if self._last_was_cr and text.startswith("\n"):
            text = text[1:]
        self._last_was_cr = text.endswith("\r")
        self._buffer += text
        lines = self._buffer.replace("\r\n", "\n").replace("\r", "\n").split("\n")
        self._buffer = lines.pop()  # the last piece has no line end yet
        events: list[SSEEvent] = []
        for line in lines:
            event = self._process_line(line)
            if event is not None:
                events.append(event)
        return events

    def close(self) -> list[SSEEvent]:
        """End of stream: a final event not followed by a blank line is still dispatched (servers omit it)."""
        events = self.feed("\n") if self._buffer else []
        if self._data_lines:
            events.append(self._dispatch())
        return events

    def _process_line(self, line: str) -> SSEEvent | None:
        if line == "":
            if self._data_lines:
                return self._dispatch()
            self._reset()  # an event with no data is dropped, per the spec
            return None
        if line.startswith(":"):
            return None
        field, _, value = line.partition(":")
        if value.startswith(" "):
            value = value[1:]
        if field == "data":
            self._data_lines.append(value)
        elif field == "event":
            self._event_type = value
        return None

    def _dispatch(self) -> SSEEvent:
        event = SSEEvent(data="\n".join(self._data_lines), event=self._event_type or "message")
        self._reset()
        return event

    def _reset(self) -> None:
        self._data_lines = []
        self._event_type = ""

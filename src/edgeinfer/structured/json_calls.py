"""Reading tool calls out of a JSON document as it streams, one character at a time.

The reader follows the document's structure (objects, arrays, strings, scalars) and reports the call
objects found at one place in it: the root (`{"name": ..., "arguments": {...}}`) or inside it
(`{"tool_calls": [...]}`).
A call's name is reported once its string is complete; its arguments are reported as the raw text the model
wrote, piece by piece, so that the pieces put together are the arguments' JSON text, as OpenAI streams them.
Arguments the model wrote as a JSON string (JSON text inside a string) are reported whole, decoded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from edgeinfer.structured.tools import NAME_PATTERN

ARRAY = "["  # a step of a call path that enters an array
_WHITESPACE = " \t\n\r"
_SCALAR_START = "-0123456789tfn"


@dataclass
class CallEvent:
    """`begin` (a call's name is known), `args` (a piece of its arguments' text), or `end` (its object
    closed; `valid` False when it had no usable name or arguments)."""

    kind: str
    text: str = ""
    call_id: str | None = None
    valid: bool = True


@dataclass
class _Frame:
    kind: str  # "{" or "["
    expect: str  # what the next non-space character may be
    key: str | None = None  # the key whose value is being read (objects)


@dataclass
class _Call:
    depth: int  # number of frames open inside the call object
    name: str | None = None
    args: str | None = None  # raw text so far
    args_depth: int | None = None  # frames open when the arguments began; None outside them
    args_string: bool = False
    sent: int = 0  # characters of `args` reported
    pending: list[str] = field(default_factory=list)


class JsonCallReader:
    """Feed text; each `feed` returns the events it completed. `done` once the root value has closed;
    `failed` once the text is not JSON (what follows is not read)."""

    def __init__(self, path: tuple[str, ...], args_keys: tuple[str, ...]) -> None:
        self._path = path
        self._args_keys = args_keys
        self._frames: list[_Frame] = []
        self._string: list[str] | None = None  # raw characters of the string being read, quotes included
        self._escaped = False
        self._scalar: list[str] | None = None
        self._call: _Call | None = None
        self._events: list[CallEvent] = []
        self._just_closed = False  # the current character closed the arguments' value (it is theirs)
        self.done = False
        self.failed = False
        self.calls_seen = 0

    def feed(self, text: str) -> list[CallEvent]:
        for ch in text:
            if self.done or self.failed:
                break
            self._char(ch)
        self._report_args()
        events, self._events = self._events, []
        return events

    def finish(self) -> list[CallEvent]:
        """The end of the text: a number at the very end is complete."""
        if self._scalar is not None and not self.failed:
            self._end_scalar()
        return self.feed("")

    # ---- characters ------------------------------------------------------------------------------
    def _char(self, ch: str) -> None:
        call = self._call
        if self._string is not None:
            self._string_char(ch)
        elif self._scalar is not None and ch not in _WHITESPACE + ",}]":
            self._scalar.append(ch)
        else:
            if self._scalar is not None:
                self._end_scalar(by_delimiter=True)
            if ch not in _WHITESPACE:
                self._structure(ch)
        if call is not None and call.args is not None and (call.args_depth is not None or self._just_closed):
            call.args += ch
        self._just_closed = False

    def _string_char(self, ch: str) -> None:
        assert self._string is not None
        self._string.append(ch)
        if self._escaped:
            self._escaped = False
        elif ch == "\\":
            self._escaped = True
        elif ch == '"':
            raw, self._string = "".join(self._string), None
            self._string_done(raw)

    def _structure(self, ch: str) -> None:
        frame = self._frames[-1] if self._frames else None
        expect = frame.expect if frame is not None else "value"
        if expect in ("value", "value_or_end") and not (expect == "value_or_end" and ch == "]"):
            self._value_start(ch)
        elif expect in ("key", "key_or_end") and ch == '"':
            self._string, self._escaped = [ch], False
        elif expect == "colon" and ch == ":":
            assert frame is not None
            frame.expect = "value"
        elif expect == "comma_or_end" and ch == ",":
            assert frame is not None
            frame.expect = "key" if frame.kind == "{" else "value"
        elif (ch == "}" and frame and frame.kind == "{" and expect in ("key_or_end", "comma_or_end")) or (
            ch == "]" and frame and frame.kind == "[" and expect in ("value_or_end", "comma_or_end")
        ):
            self._close()
        else:
            self.failed = True

    def _value_start(self, ch: str) -> None:
        self._maybe_begin_call(ch)
        self._maybe_begin_args(ch)
        if ch in "{[":
            self._frames.append(_Frame(ch, "key_or_end" if ch == "{" else "value_or_end"))
        elif ch == '"':
            self._string, self._escaped = [ch], False
        elif ch in _SCALAR_START:
            self._scalar = [ch]
        else:
            self.failed = True

    # ---- values ----------------------------------------------------------------------------------
    def _string_done(self, raw: str) -> None:
        frame = self._frames[-1] if self._frames else None
        if frame is not None and frame.kind == "{" and frame.expect in ("key", "key_or_end"):
            frame.key, frame.expect = _decode(raw), "colon"
            return
        call = self._call
        if call is not None and len(self._frames) == call.depth and frame is not None and frame.key == "name":
            name = _decode(raw)
            call.name = name if isinstance(name, str) and NAME_PATTERN.match(name) else None
            if call.name is not None:
                self._events.append(CallEvent("begin", call.name))
        self._value_done()

    def _end_scalar(self, by_delimiter: bool = False) -> None:
        """A number or literal ends at the first character that is not its own (not part of the value)."""
        raw, self._scalar = "".join(self._scalar or []), None
        try:
            json.loads(raw)
        except ValueError:
            self.failed = True
            return
        self._value_done(includes_current=not by_delimiter)

    def _close(self) -> None:
        self._frames.pop()
        call = self._call
        if call is not None and len(self._frames) < call.depth:
            self._end_call(call)
        self._value_done()

    def _value_done(self, includes_current: bool = True) -> None:
        call = self._call
        if call is not None and call.args_depth is not None and len(self._frames) == call.args_depth:
            call.args_depth, self._just_closed = None, includes_current
        if self._frames:
            self._frames[-1].expect = "comma_or_end"
        else:
            self.done = True

    # ---- calls -----------------------------------------------------------------------------------
    def _here(self) -> tuple[str | None, ...]:
        return tuple(f.key if f.kind == "{" else ARRAY for f in self._frames)

    def _maybe_begin_call(self, ch: str) -> None:
        if ch == "{" and self._call is None and self._here() == self._path:
            self._call = _Call(depth=len(self._frames) + 1)
            self.calls_seen += 1

    def _maybe_begin_args(self, ch: str) -> None:
        call = self._call
        frame = self._frames[-1] if self._frames else None
        if call is None or frame is None or len(self._frames) != call.depth:
            return
        if frame.key in self._args_keys and call.args is None:
            call.args, call.args_depth, call.args_string = "", len(self._frames), ch == '"'

    def _report_args(self) -> None:
        """New argument text, once the name is known; a JSON string's text only when whole."""
        call = self._call
        if call is None or call.name is None or call.args is None or call.args_string:
            return
        if len(call.args) > call.sent:
            self._events.append(CallEvent("args", call.args[call.sent :]))
            call.sent = len(call.args)

    def _end_call(self, call: _Call) -> None:
        self._call = None
        if call.args_string and call.args is not None and call.name is not None:
            decoded = _decode(call.args)
            call.args_string = False
            call.args = decoded if isinstance(decoded, str) else None
        if call.name is not None and call.args is None:
            call.args = "{}"  # a call without arguments
        if call.name is not None:
            self._call = call
            self._report_args()
            self._call = None
        self._events.append(CallEvent("end", valid=call.name is not None and call.args is not None))


def _decode(raw: str) -> object:
    try:
        return json.loads(raw)
    except ValueError:
        return None

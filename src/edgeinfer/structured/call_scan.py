"""Each family's tool calls read as the text streams: scanners that turn text into call events.

A scanner is fed the text of an answer from where its calls begin (the format's opener, or the first `{` of
a JSON answer) and reports `begin` / `args` / `end` events (json_calls.CallEvent). Markers that may be split
across deltas are held back until they are whole; a scanner never reports a piece of text twice.
"""

from __future__ import annotations

import abc
import json

from edgeinfer.structured.json_calls import ARRAY, CallEvent, JsonCallReader
from edgeinfer.structured.tools import NAME_PATTERN


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def held(text: str, marker: str) -> str:
    """What of `text` may still begin `marker` (kept while the rest is passed over)."""
    return text[len(text) - partial_suffix(text, marker) :]


class CallScanner(abc.ABC):
    @abc.abstractmethod
    def feed(self, text: str) -> list[CallEvent]:
        """The events completed by `text`."""

    def finish(self) -> list[CallEvent]:
        """The events the end of the answer completes."""
        return []


class JsonDocumentScanner(CallScanner):
    """The whole answer is one JSON document holding the calls at `path` (after an optional `tag`)."""

    def __init__(self, path: tuple[str, ...], args_keys: tuple[str, ...], tag: str | None = None) -> None:
        self._reader = JsonCallReader(path, args_keys)
        self._tag = tag
        self._head = ""  # leading text until it is known whether the tag is there

    def feed(self, text: str) -> list[CallEvent]:
        if self._head is not None:
            self._head += text
            head = self._head.lstrip()
            if self._tag and head.startswith(self._tag):
                head = head[len(self._tag) :]
            elif self._tag and self._tag.startswith(head):
                return []
            text, self._head = head, None
        return self._reader.feed(text)

    def finish(self) -> list[CallEvent]:
        return self._reader.finish()


class TaggedJsonScanner(CallScanner):
    """Calls as JSON objects, each between `opener` and `closer` (Hermes / Qwen 3)."""

    def __init__(self, opener: str, closer: str, args_keys: tuple[str, ...] = ("arguments",)) -> None:
        self._opener, self._closer, self._args_keys = opener, closer, args_keys
        self._buffer = ""
        self._reader: JsonCallReader | None = None

    def feed(self, text: str) -> list[CallEvent]:
        self._buffer += text
        events: list[CallEvent] = []
        while True:
            if self._reader is None:
                start = self._buffer.find(self._opener)
                if start < 0:
                    self._buffer = held(self._buffer, self._opener)
                    return events
                self._buffer = self._buffer[start + len(self._opener) :]
                self._reader = JsonCallReader((), self._args_keys)
            body, self._buffer = self._buffer, ""
            events += self._reader.feed(body)
            if not (self._reader.done or self._reader.failed):
                return events
            # the rest of the body (the closer, what follows) is looked at for the next opener
            self._buffer = body[self._consumed(body) :]
            self._reader = None

    def finish(self) -> list[CallEvent]:
        return self._reader.finish() if self._reader is not None else []

    def _consumed(self, body: str) -> int:
        """Where the closer after a finished call body ends (or all of it, when there is none yet)."""
        end = body.find(self._closer)
        return end + len(self._closer) if end >= 0 else len(body)


class PieceScanner(CallScanner):
    """A scanner that takes whole pieces (a marker, a name, an argument) off a buffer, one `_step` each."""

    def __init__(self) -> None:
        self._buffer = ""

    def feed(self, text: str) -> list[CallEvent]:
        self._buffer += text
        events: list[CallEvent] = []
        while self._step(events):
            pass
        return events

    @abc.abstractmethod
    def _step(self, events: list[CallEvent]) -> bool:
        """Consume one whole piece from the buffer; False when it holds none yet."""


class Glm45Scanner(PieceScanner):
    """`<tool_call>NAME\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>...</tool_call>`: each argument is
    reported once its value is whole, as the next piece of a JSON object (`{"K": V` then `, "K2": V2`, `}`):
    string values are written raw, others as JSON."""

    _OPEN, _CLOSE = "<tool_call>", "</tool_call>"
    _KEY, _KEY_END, _VALUE, _VALUE_END = "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"

    def __init__(self) -> None:
        super().__init__()
        self._in_call = False
        self._name: str | None = None
        self._args = 0

    def _step(self, events: list[CallEvent]) -> bool:
        if not self._in_call:
            start = self._buffer.find(self._OPEN)
            if start < 0:
                self._buffer = held(self._buffer, self._OPEN)
                return False
            self._buffer = self._buffer[start + len(self._OPEN) :]
            self._in_call, self._name, self._args = True, None, 0
            return True
        if self._name is None:
            return self._take_name(events)
        return self._take_argument(events)

    def _take_name(self, events: list[CallEvent]) -> bool:
        found = (self._buffer.find(marker) for marker in (self._KEY, self._CLOSE, "\n"))
        cut = min((i for i in found if i >= 0), default=-1)
        if cut < 0:
            return False
        name = self._buffer[:cut].strip()
        if not name and self._buffer[cut] == "\n":
            self._buffer = self._buffer[cut + 1 :]
            return True
        self._buffer = self._buffer[cut:]
        self._name = name if NAME_PATTERN.match(name) else ""
        if self._name:
            events.append(CallEvent("begin", self._name))
        return True

    def _take_argument(self, events: list[CallEvent]) -> bool:
        head = self._buffer.lstrip()
        if head.startswith(self._CLOSE):
            self._buffer = head[len(self._CLOSE) :]
            self._in_call = False
            if self._name:
                events.append(CallEvent("args", "}" if self._args else "{}"))
            events.append(CallEvent("end", valid=bool(self._name)))
            return True
        end = head.find(self._VALUE_END)
        if not head.startswith(self._KEY) or end < 0:
            return False
        body, self._buffer = head[:end], head[end + len(self._VALUE_END) :]
        key, _, value = body[len(self._KEY) :].partition(self._KEY_END)
        value = value.strip().removeprefix(self._VALUE)
        if self._name:
            piece = f"{json.dumps(key.strip(), ensure_ascii=False)}: {_glm_json(value)}"
            events.append(CallEvent("args", ("{" if not self._args else ", ") + piece))
        self._args += 1
        return True


def _glm_json(raw: str) -> str:
    """A GLM argument value as JSON text: JSON where it parses, else the raw string."""
    value = raw.strip()
    try:
        return json.dumps(json.loads(value), ensure_ascii=False)
    except ValueError:
        return json.dumps(raw, ensure_ascii=False)


class KimiK2Scanner(PieceScanner):
    """`<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{...}<|tool_call_end|>` per call;
    the arguments stream as written, the call id is the model's own `functions.NAME:IDX`."""

    _BEGIN, _ARGS, _END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"

    def __init__(self) -> None:
        super().__init__()
        self._state = "between"  # between calls, in a call's id, or in its arguments
        self._args = ""  # the current call's arguments so far

    def _step(self, events: list[CallEvent]) -> bool:
        if self._state == "between":
            start = self._buffer.find(self._BEGIN)
            if start < 0:
                self._buffer = held(self._buffer, self._BEGIN)
                return False
            self._buffer, self._state = self._buffer[start + len(self._BEGIN) :], "id"
            return True
        if self._state == "id":
            cut = self._buffer.find(self._ARGS)
            if cut < 0:
                return False
            call_id, self._buffer = self._buffer[:cut].strip(), self._buffer[cut + len(self._ARGS) :]
            name = call_id.split(".", 1)[-1].rsplit(":", 1)[0]
            self._state = "args" if NAME_PATTERN.match(name) else "skip"
            self._args = ""
            if self._state == "args":
                events.append(CallEvent("begin", name, call_id=call_id))
            return True
        end = self._buffer.find(self._END)
        ready = end if end >= 0 else len(self._buffer) - partial_suffix(self._buffer, self._END)
        if ready and self._state == "args":
            events.append(CallEvent("args", self._buffer[:ready]))
            self._args += self._buffer[:ready]
        self._buffer = self._buffer[ready:]
        if end < 0:
            return False
        self._buffer = self._buffer[len(self._END) :]
        events.append(CallEvent("end", valid=self._state == "args" and is_json(self._args)))
        self._state = "between"
        return True


def is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def json_answer_scanner() -> CallScanner:
    """Our JSON form: `{"tool_calls": [{"name": ..., "arguments": {...}}, ...]}`."""
    return JsonDocumentScanner(("tool_calls", ARRAY), ("arguments",))


def llama3_scanner() -> CallScanner:
    """Llama 3.1: the answer is one call object, optionally after `<|python_tag|>`."""
    return JsonDocumentScanner((), ("parameters", "arguments"), tag="<|python_tag|>")

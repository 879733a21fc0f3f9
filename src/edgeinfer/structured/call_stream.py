"""Tool calls as OpenAI stream deltas: the call's index, id and name first, then pieces of its arguments.

A model forced to call tools may call the same function with the same arguments again and again until its
token budget ends (nothing in a grammar forbids a repeat). A call that repeats an earlier one is held back
while it still reads like that one; if it completes identical it is dropped and `repeated` is set, so that
the caller ends the answer there. Calls that diverge are released at once, with what was held.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from edgeinfer.structured.call_scan import CallScanner, is_json
from edgeinfer.structured.json_calls import CallEvent
from edgeinfer.structured.tools import new_call_id


@dataclass
class _Call:
    name: str
    id: str
    args: str = ""
    index: int | None = None  # set once the call is announced
    sent: int = 0  # characters of `args` sent


@dataclass
class CallStream:
    scanner: CallScanner
    repeated: bool = False  # the last call repeated an earlier one: the answer should end
    num_calls: int = 0  # calls announced
    began: bool = False  # a call was seen: the text is calls, not content
    _done: list[tuple[str, str]] = field(default_factory=list)
    _call: _Call | None = None

    def feed(self, text: str) -> list[dict[str, Any]]:
        """OpenAI `tool_calls` delta items for the text."""
        return self._apply(self.scanner.feed(text)) if not self.repeated else []

    def finish(self) -> list[dict[str, Any]]:
        """The last deltas; a call left open (the answer was cut) stays as sent."""
        return self._apply(self.scanner.finish()) if not self.repeated else []

    def _apply(self, events: list[CallEvent]) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        for event in events:
            if self.repeated:
                break
            if event.kind == "begin":
                if self._call is not None:  # its text broke off before it closed
                    deltas += self._end(self._call, valid=False)
                self.began = True
                self._call = _Call(event.text, event.call_id or new_call_id())
            elif self._call is not None and event.kind == "args":
                self._call.args += event.text
                deltas += self._release(self._call)
            elif self._call is not None and event.kind == "end":
                deltas += self._end(self._call, event.valid)
        return deltas

    def _release(self, call: _Call, whole: bool = False) -> list[dict[str, Any]]:
        """Deltas for what of `call` can be sent: nothing while it may still repeat an earlier call,
        unless it is `whole` (it has ended, and is not a repeat)."""
        out = []
        if call.index is None:
            if not whole and any(n == call.name and a.startswith(call.args) for n, a in self._done):
                return []
            call.index = self.num_calls
            self.num_calls += 1
            function = {"name": call.name, "arguments": ""}
            out.append({"index": call.index, "id": call.id, "type": "function", "function": function})
        if len(call.args) > call.sent:
            out.append({"index": call.index, "function": {"arguments": call.args[call.sent :]}})
            call.sent = len(call.args)
        return out

    def _end(self, call: _Call, valid: bool) -> list[dict[str, Any]]:
        self._call = None
        if call.index is None and (call.name, call.args) in self._done:
            self.repeated = True
            return []
        if not valid and call.index is None:
            return []  # never announced, never will be: not a call
        self._done.append((call.name, call.args))
        return self._release(call, whole=True)


def merge_call_deltas(items: list[dict[str, Any]], complete_only: bool = True) -> list[dict[str, Any]]:
    """Streamed `tool_calls` delta items put together per index, as an OpenAI client does: whole calls
    (`id`, `type`, `function.name`, `function.arguments`). With `complete_only`, a call whose arguments are
    not JSON (its answer was cut while writing it) is left out."""
    calls: dict[int, dict[str, Any]] = {}
    for item in items:
        index = int(item.get("index", len(calls)))
        function = item.get("function") or {}
        empty = {"id": None, "type": "function", "function": {"name": "", "arguments": ""}}
        call = calls.setdefault(index, empty)
        call["id"] = item.get("id") or call["id"]
        call["function"]["name"] += function.get("name") or ""
        call["function"]["arguments"] += function.get("arguments") or ""
    merged = [calls[i] for i in sorted(calls)]
    return [c for c in merged if not complete_only or is_json(c["function"]["arguments"])]

"""Each family's tool-call format: how a model writes calls (parsed back into `ToolCall`s) and the grammar
that forces calls when `tool_choice` is `required` or names a function.

| format  | the model writes |
|---|---|
| json    | `{"tool_calls": [{"name": "f", "arguments": {...}}]}`: our form for models without a native one |
| llama3  | `{"name": "f", "parameters": {...}}` (Llama 3.1's JSON tool calling; one call per turn) |
| qwen3   | `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>` per call (Hermes style) |
| glm45   | `<tool_call>f\\n<arg_key>k</arg_key>\\n<arg_value>v</arg_value>\\n</tool_call>` per call |
| kimi_k2 | `<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{...}`
|         | `<|tool_call_end|>...<|tool_calls_section_end|>` |

Grammars are llguidance Lark; `token(text)` spells a marker as its single vocabulary token (`<[id]>`) when
the vocabulary has one, so a forced call uses the same special tokens the model was trained on.
"""

from __future__ import annotations

import abc
import json
from collections.abc import Callable
from typing import Any

from edgeinfer.structured.call_scan import (
    CallScanner,
    Glm45Scanner,
    KimiK2Scanner,
    TaggedJsonScanner,
    json_answer_scanner,
    llama3_scanner,
)
from edgeinfer.structured.call_stream import CallStream, merge_call_deltas
from edgeinfer.structured.grammar import inline_json
from edgeinfer.structured.tools import Tool, ToolCall, ToolChoice, dumps

TokenRef = Callable[[str], str]


def literal(text: str) -> str:
    return json.dumps(text)


class ToolFormat(abc.ABC):
    name: str
    # Text that opens a call section; while a suffix of streamed content could start it, it is held back.
    # None: the whole answer is one JSON document, recognised by its first character `{`.
    opener: str | None = None

    @abc.abstractmethod
    def scanner(self) -> CallScanner:
        """A reader of this format's calls as they stream (fed from where the calls begin)."""

    def calls_start(self, text: str) -> int:
        """Where the calls begin in a whole answer; -1 when it holds none."""
        if self.opener is not None:
            return text.find(self.opener)
        head = text.lstrip()
        return len(text) - len(head) if head.startswith(("{", "<|python_tag|>")) else -1

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content before the calls, complete calls) of a whole answer, read as a stream would read it;
        text without calls comes back whole as content."""
        start = self.calls_start(text)
        if start < 0:
            return text, []
        stream = CallStream(self.scanner())
        calls = merge_call_deltas(stream.feed(text[start:]) + stream.finish())
        if not calls:
            return text, []
        found = [ToolCall(c["function"]["name"], c["function"]["arguments"], id=c["id"]) for c in calls]
        return text[:start].rstrip(), found

    @abc.abstractmethod
    def grammar(self, tools: list[Tool], choice: ToolChoice, parallel: bool, token: TokenRef) -> str:
        """Lark text forcing at least one call (only that function when `choice.name` is set)."""

    @staticmethod
    def callable_tools(tools: list[Tool], choice: ToolChoice) -> list[Tool]:
        return [t for t in tools if choice.name is None or t.name == choice.name]


def _call_schema(tool: Tool, args_key: str) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": tool.name}, args_key: tool.parameters},
        "required": ["name", args_key],
        "additionalProperties": False,
    }


def _any_call_schema(tools: list[Tool], args_key: str) -> dict[str, Any]:
    options = [_call_schema(t, args_key) for t in tools]
    return options[0] if len(options) == 1 else {"anyOf": options}


class JsonFormat(ToolFormat):
    """The answer is `{"tool_calls": [...]}` or plain text; documented in docs/structured-outputs.md."""

    name = "json"

    def scanner(self) -> CallScanner:
        return json_answer_scanner()

    def grammar(self, tools: list[Tool], choice: ToolChoice, parallel: bool, token: TokenRef) -> str:
        array: dict[str, Any] = {
            "type": "array",
            "items": _any_call_schema(self.callable_tools(tools, choice), "arguments"),
        }
        array.update(minItems=1, **({} if parallel else {"maxItems": 1}))
        schema = {"type": "object", "properties": {"tool_calls": array}, "required": ["tool_calls"]}
        return f"start: {inline_json({**schema, 'additionalProperties': False})}"

    @staticmethod
    def render_calls(calls: list[dict[str, Any]]) -> str:
        """An assistant turn's calls in this form, for prompts of models without a native format."""
        return dumps({"tool_calls": [{"name": c["name"], "arguments": c["arguments"]} for c in calls]})


class Llama3Format(ToolFormat):
    """Llama 3.1 JSON tool calling: the whole answer is one call object (`<|python_tag|>` optional)."""

    name = "llama3"

    def scanner(self) -> CallScanner:
        return llama3_scanner()

    def grammar(self, tools: list[Tool], choice: ToolChoice, parallel: bool, token: TokenRef) -> str:
        # The format has one call per assistant turn: `parallel` cannot be honoured.
        return f"start: {inline_json(_any_call_schema(self.callable_tools(tools, choice), 'parameters'))}"


class Qwen3Format(ToolFormat):
    name = "qwen3"
    opener = "<tool_call>"

    def scanner(self) -> CallScanner:
        return TaggedJsonScanner(self.opener, "</tool_call>")

    def grammar(self, tools: list[Tool], choice: ToolChoice, parallel: bool, token: TokenRef) -> str:
        schema = inline_json(_any_call_schema(self.callable_tools(tools, choice), "arguments"))
        more = ' ("\\n" call)*' if parallel else ""
        return (
            f'start: call{more}\ncall: {token("<tool_call>")} "\\n" {schema} "\\n" {token("</tool_call>")}\n'
        )


class Glm45Format(ToolFormat):
    """GLM-4.5: string arguments are written raw, other types as JSON."""

    name = "glm45"
    opener = "<tool_call>"

    def scanner(self) -> CallScanner:
        return Glm45Scanner()

    def grammar(self, tools: list[Tool], choice: ToolChoice, parallel: bool, token: TokenRef) -> str:
        callable_ = self.callable_tools(tools, choice)
        more = ' ("\\n" call)*' if parallel else ""
        rules = [f"start: call{more}", "call: " + " | ".join(f"call_{i}" for i in range(len(callable_)))]
        open_, close = token("<tool_call>"), token("</tool_call>")
        for i, tool in enumerate(callable_):
            args = " ".join(self._arg(tool, key, schema, token) for key, schema in _properties(tool))
            rules.append(f"call_{i}: {open_} {literal(tool.name + chr(10))} {args} {close}")
        return "\n".join(rules) + "\n"

    @staticmethod
    def _arg(tool: Tool, key: str, schema: dict[str, Any], token: TokenRef) -> str:
        # Properties in declared order; optional ones may be left out.
        value = _glm_string(schema) if schema.get("type") == "string" else inline_json(schema)
        head = f'{token("<arg_key>")} {literal(key)} {token("</arg_key>")} "\\n" {token("<arg_value>")}'
        item = f'({head} {value} {token("</arg_value>")} "\\n")'
        return item if key in tool.parameters.get("required", []) else item + "?"


def _glm_string(schema: dict[str, Any]) -> str:
    """A raw string value: no `<` (it would open the closing tag); `maxLength` bounds it when given."""
    limit = schema.get("maxLength")
    return f"/[^<]{{0,{int(limit)}}}/" if isinstance(limit, int) else "/[^<]*/"


def _properties(tool: Tool) -> list[tuple[str, dict[str, Any]]]:
    props = tool.parameters.get("properties") or {}
    return [(k, v if isinstance(v, dict) else {}) for k, v in props.items()]


class KimiK2Format(ToolFormat):
    name = "kimi_k2"
    opener = "<|tool_calls_section_begin|>"

    def scanner(self) -> CallScanner:
        return KimiK2Scanner()

    def grammar(self, tools: list[Tool], choice: ToolChoice, parallel: bool, token: TokenRef) -> str:
        callable_ = self.callable_tools(tools, choice)
        begin, end = token("<|tool_calls_section_begin|>"), token("<|tool_calls_section_end|>")
        rules = [f"start: {begin} call{'+' if parallel else ''} {end}"]
        rules.append("call: " + " | ".join(f"call_{i}" for i in range(len(callable_))))
        for i, tool in enumerate(callable_):
            head = f"{token('<|tool_call_begin|>')} {literal(f'functions.{tool.name}:')} /[0-9]{{1,2}}/"
            args = f"{token('<|tool_call_argument_begin|>')} {inline_json(tool.parameters)}"
            rules.append(f"call_{i}: {head} {args} {token('<|tool_call_end|>')}")
        return "\n".join(rules) + "\n"


FORMATS: dict[str, ToolFormat] = {
    f.name: f for f in (JsonFormat(), Llama3Format(), Qwen3Format(), Glm45Format(), KimiK2Format())
}

# HF `model_type` → the family's native format; anything else gets the JSON form.
_BY_MODEL_TYPE = {
    "llama": "llama3",
    "qwen2": "qwen3",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3",
    "glm4_moe": "glm45",
    "kimi_k2": "kimi_k2",
}
# Families whose answers may open with a `<think>...</think>` block.
THINKING_FORMATS = frozenset({"qwen3", "glm45"})


def format_for(model_type: str | None, vocabulary: Callable[[str], bool]) -> ToolFormat:
    """The format of a checkpoint, by its `model_type`. Kimi K2 checkpoints say `kimi_k2` or reuse
    DeepSeek V3's `deepseek_v3`; the latter are told apart by Kimi's tool-call section token."""
    if model_type == "deepseek_v3" and vocabulary("<|tool_calls_section_begin|>"):
        return FORMATS["kimi_k2"]
    return FORMATS[_BY_MODEL_TYPE.get(model_type or "", "json")]

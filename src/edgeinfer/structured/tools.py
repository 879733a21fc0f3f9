"""Tool definitions and `tool_choice`, validated from OpenAI request bodies; the tool calls parsed back."""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

from edgeinfer.structured.grammar import GrammarError, json_schema_grammar

NAME_PATTERN = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
AUTO, NONE, REQUIRED = "auto", "none", "required"


@dataclass(frozen=True)
class Tool:
    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})

    def as_openai(self) -> dict[str, Any]:
        """The tool as chat templates expect it (`{"type": "function", "function": {...}}`)."""
        function = {"name": self.name, "description": self.description, "parameters": self.parameters}
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolChoice:
    """`mode` is auto, none or required; `name` set means that one function must be called."""

    mode: str = AUTO
    name: str | None = None

    @property
    def forced(self) -> bool:
        return self.mode == REQUIRED

    @property
    def enabled(self) -> bool:
        return self.mode != NONE


@dataclass
class ToolCall:
    """One parsed call: `arguments` is JSON text, as the OpenAI API returns it."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: new_call_id())

    def as_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def parse_tools(raw: Any) -> list[Tool]:
    """Validate `tools`; each parameter schema must compile (so a forced call can be constrained to it)."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise ValueError("tools must be a list of {type: function, function: {...}} objects")
    tools = [_tool(i, item) for i, item in enumerate(raw)]
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise ValueError("tools: function names must be unique")
    return tools


def _tool(index: int, item: Any) -> Tool:
    where = f"tools[{index}]"
    if not isinstance(item, dict) or item.get("type", "function") != "function":
        raise ValueError(f"{where} must be {{'type': 'function', 'function': {{...}}}}")
    function = item.get("function")
    if not isinstance(function, dict):
        raise ValueError(f"{where}.function must be an object")
    name = function.get("name")
    if not isinstance(name, str) or not NAME_PATTERN.match(name):
        raise ValueError(f"{where}.function.name must be 1-64 letters, digits, '_', '.' or '-'")
    params = function.get("parameters") or {"type": "object", "properties": {}}
    if not isinstance(params, dict):
        raise ValueError(f"{where}.function.parameters must be a JSON schema object")
    try:
        json_schema_grammar(params)
    except GrammarError as exc:
        raise ValueError(f"{where}.function.parameters: {exc}") from None
    description = function.get("description") or ""
    return Tool(name, description if isinstance(description, str) else "", params)


def parse_tool_choice(raw: Any, tools: list[Tool]) -> ToolChoice:
    """`auto` by default with tools, `none` without; `required`, or one named function."""
    if raw is None:
        return ToolChoice(AUTO if tools else NONE)
    if raw in (AUTO, NONE, REQUIRED):
        if raw != NONE and not tools:
            raise ValueError(f"tool_choice {raw!r} needs tools")
        return ToolChoice(raw)
    name = raw.get("function", {}).get("name") if isinstance(raw, dict) else None
    if not isinstance(name, str):
        raise ValueError("tool_choice must be auto, none, required or {type: function, function: {name}}")
    if name not in {t.name for t in tools}:
        raise ValueError(f"tool_choice names function {name!r}, which is not in tools")
    return ToolChoice(REQUIRED, name)


def arguments_object(arguments: Any) -> Any:
    """A call's arguments as an object for chat templates (OpenAI clients send JSON text)."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)

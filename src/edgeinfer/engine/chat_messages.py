"""Validating OpenAI-style chat messages into the plain shape every chat template reads.

Content becomes one string (text parts joined by a newline). Assistant tool calls keep their ids and carry
their arguments as an object (templates write them with `tojson`; OpenAI clients send JSON text); tool
results keep `tool_call_id`; reasoning is given under both names templates read (`reasoning_content`,
`thinking`), as transformers does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from edgeinfer.structured.tools import arguments_object

ROLES = ("system", "user", "assistant", "tool")

Message = dict[str, Any]


def normalize_messages(messages: Any) -> list[Message]:
    """Validate messages into `[{"role", "content": str, ...}]`; bad input raises ValueError."""
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise ValueError("messages must be a non-empty list of {role, content} objects")
    return [_normalize_one(i, message) for i, message in enumerate(messages)]


def _normalize_one(index: int, message: Any) -> Message:
    if not isinstance(message, dict):
        raise ValueError(
            f"messages[{index}] must be an object with role and content, got {type(message).__name__}"
        )
    role = message.get("role")
    if role not in ROLES:
        raise ValueError(f"messages[{index}].role must be one of {', '.join(ROLES)}, got {role!r}")
    calls = message.get("tool_calls") if role == "assistant" else None
    content = message.get("content")
    if content is None and (calls or role == "tool"):
        content = ""
    out: Message = {"role": role, "content": _content_text(index, content)}
    if calls:
        out["tool_calls"] = [_tool_call(index, j, call) for j, call in enumerate(calls)]
    if role == "tool":
        for key in ("tool_call_id", "name"):
            if isinstance(message.get(key), str):
                out[key] = message[key]
    reasoning = message.get("reasoning_content")
    if role == "assistant" and isinstance(reasoning, str):
        out = {"thinking": reasoning, **out, "reasoning_content": reasoning}
    return out


def _content_text(index: int, content: Any) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"messages[{index}].content must be a string or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ValueError(f"messages[{index}].content[{j}] must be {{'type': 'text', 'text': <string>}}")
        texts.append(part["text"])
    return "\n".join(texts)


def _tool_call(index: int, j: int, call: Any) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ValueError(f"messages[{index}].tool_calls[{j}] must be {{'function': {{'name', 'arguments'}}}}")
    out: dict[str, Any] = {
        "type": "function",
        "function": {"name": function["name"], "arguments": arguments_object(function.get("arguments", {}))},
    }
    if isinstance(call.get("id"), str):
        out = {"id": call["id"], **out}
    return out

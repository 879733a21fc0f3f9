"""Tools in the prompt of a model whose chat template has no place for them: the JSON tool form.

The tool list and the answer form go into the system message; earlier calls are written back as the
assistant's JSON answers and tool results as user turns (`Tool result (name): ...`), merged with a
neighbouring user turn so that strict alternation (Gemma's) holds. Other messages pass unchanged.
"""

from __future__ import annotations

import json
from typing import Any

from edgeinfer.structured.formats import JsonFormat

PREAMBLE = (
    "You can call these tools (JSON schemas of their arguments):\n{tools}\n\n"
    "To call tools, answer with only this JSON and nothing else:\n"
    '{{"tool_calls": [{{"name": "<tool name>", "arguments": {{<arguments>}}}}]}}\n'
    "Otherwise answer normally."
)


def tools_preamble(tools: list[dict[str, Any]]) -> str:
    listed = "\n".join(json.dumps(t.get("function", t), ensure_ascii=False) for t in tools)
    return PREAMBLE.format(tools=listed)


def json_form_messages(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[dict[str, Any]]:
    """The conversation with tools, calls and results written as plain text turns."""
    out: list[dict[str, Any]] = []
    if tools:
        preamble = tools_preamble(tools)
        if messages and messages[0]["role"] == "system":
            out.append({"role": "system", "content": f"{messages[0]['content']}\n\n{preamble}"})
            messages = messages[1:]
        else:
            out.append({"role": "system", "content": preamble})
    for message in messages:
        _append(out, _as_text_turn(message))
    return out


def _as_text_turn(message: dict[str, Any]) -> dict[str, Any]:
    role = message["role"]
    if role == "tool":
        name = message.get("name") or message.get("tool_call_id") or "tool"
        return {"role": "user", "content": f"Tool result ({name}): {message['content']}"}
    if role == "assistant" and message.get("tool_calls"):
        calls = [c["function"] for c in message["tool_calls"]]
        text = JsonFormat.render_calls(calls)
        return {
            "role": "assistant",
            "content": f"{message['content']}\n{text}" if message["content"] else text,
        }
    return {"role": role, "content": message["content"]}


def _append(out: list[dict[str, Any]], turn: dict[str, Any]) -> None:
    if out and out[-1]["role"] == turn["role"] == "user":
        out[-1] = {"role": "user", "content": f"{out[-1]['content']}\n\n{turn['content']}"}
    else:
        out.append(turn)

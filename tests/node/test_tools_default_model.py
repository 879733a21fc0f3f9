"""Forced tool calls on the real default model (Gemma 3 270M, our JSON call form) with the default
`parallel_tool_calls`: the model tends to repeat its call until the token budget ends; the repeat ends the
answer, the calls come back as `tool_calls`, and a stream carries the same calls as deltas."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from edgeinfer.engine.config import EngineConfig

pytestmark = pytest.mark.gemma

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather of a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 20}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {"name": "get_time", "parameters": {"type": "object", "additionalProperties": False}},
    },
]
ASK = [{"role": "user", "content": "What is the weather in Paris and in Rome?"}]


@pytest.fixture(scope="module")
def client(default_gguf: Any, module_node_factory: Any) -> openai.OpenAI:
    engine = EngineConfig(batch_window_ms=0, kv_cache_memory_bytes=64 * 2**20)
    node = module_node_factory({"gemma": str(default_gguf)}, engine=engine, preload=("gemma",))
    return openai.OpenAI(base_url=node.url + "/v1", api_key="unused", max_retries=0)


def _calls(message: Any) -> list[tuple[str, Any]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


@pytest.mark.parametrize(
    "choice",
    ["required", {"type": "function", "function": {"name": "get_weather"}}],
    ids=["required", "named"],
)
def test_forced_calls_come_back_as_tool_calls(client: openai.OpenAI, choice: Any) -> None:
    asked = dict(model="gemma", messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=120, temperature=0)
    reply = client.chat.completions.create(**asked).choices[0]
    calls = _calls(reply.message)
    assert calls and reply.finish_reason in ("tool_calls", "length"), reply
    assert len({json.dumps(c) for c in calls}) == len(calls)  # a repeat ended the answer, unsent
    assert not reply.message.content
    if isinstance(choice, dict):
        assert {name for name, _ in calls} == {"get_weather"}
    with client.chat.completions.stream(**asked) as stream:
        final = stream.get_final_completion().choices[0]
    assert _calls(final.message) == calls and final.finish_reason == reply.finish_reason

"""Structured outputs and tool calling through a real node on loopback, driven by the openai SDK, on tiny
random models of each family (their chat templates in tests/tokenizer/templates). A random model writes
noise: every valid JSON answer and every parsed tool call here is the grammar's doing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest
from helpers.structured_models import make_structured_tiny
from pydantic import BaseModel, Field

from edgeinfer.engine.config import EngineConfig
from edgeinfer.structured.call_stream import merge_call_deltas

TEMPLATES = Path(__file__).parent.parent / "tokenizer" / "templates"
# family name -> (tiny model family, chat template file or None for the built-in format)
FAMILIES = {
    "llama3": ("llama", "llama3.jinja"),
    "qwen3": ("qwen3", "qwen3.jinja"),
    "glm45": ("glm4_moe", "glm45.jinja"),
    "kimi_k2": ("deepseek_v3", "kimi_k2.jinja"),
    "gemma": ("gemma3", None),
}
WEATHER_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather.", "parameters": WEATHER_PARAMS},
    },
    {
        "type": "function",
        "function": {"name": "get_time", "parameters": {"type": "object", "additionalProperties": False}},
    },
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class Verdict(BaseModel):
    label: Literal["yes", "no", "maybe"]
    score: int = Field(ge=0, le=9)
    note: str = Field(max_length=8)


class GetWeather(BaseModel):
    city: str = Field(max_length=10)
    days: int = Field(ge=1, le=7)


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory, module_node_factory: Any) -> Any:
    root = tmp_path_factory.mktemp("structured-node")
    models = {}
    for name, (family, template) in FAMILIES.items():
        text = (TEMPLATES / template).read_text() if template else None
        models[name] = str(
            make_structured_tiny(family, root / name, chat_template=text, max_position_embeddings=4096)
        )
    engine = EngineConfig(dtype="float32", batch_window_ms=0, block_size=4, kv_cache_memory_bytes=8 * 2**20)
    return module_node_factory(models, engine=engine, max_tokens=256)


@pytest.fixture(scope="module")
def client(node: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=node.url + "/v1", api_key="unused", max_retries=0)


def test_parse_with_a_pydantic_response_format(client: openai.OpenAI) -> None:
    for temperature in (0.0, 1.0):
        completion = client.chat.completions.parse(
            model="qwen3",
            messages=ASK,
            response_format=Verdict,
            max_tokens=64,
            temperature=temperature,
            seed=7,
        )
        message = completion.choices[0].message
        assert isinstance(message.parsed, Verdict) and completion.choices[0].finish_reason == "stop"


def test_streamed_json_schema_and_json_object(client: openai.OpenAI) -> None:
    schema = {**Verdict.model_json_schema(), "additionalProperties": False}  # closed, as strict mode sends it
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "verdict", "schema": schema, "strict": True},
    }
    stream = client.chat.completions.create(
        model="gemma",
        messages=ASK,
        response_format=response_format,
        max_tokens=64,
        stream=True,
        temperature=0,
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    jsonschema.validate(json.loads(text), schema)
    # Any JSON object: nothing bounds a random model's keys, so some answers run out of tokens; every
    # answer that ends does so as a closed object.
    completion = client.completions.create(
        model="llama3", prompt="JSON:", max_tokens=128, n=6, temperature=1.0, seed=3,
        extra_body={"response_format": {"type": "json_object"}},
    )  # fmt: skip
    ended = [c.text for c in completion.choices if c.finish_reason == "stop"]
    assert ended and all(isinstance(json.loads(text), dict) for text in ended)


def test_workers_ai_response_format(node: Any) -> None:
    schema = {"type": "object", "properties": {"answer": {"enum": ["a", "b"]}}, "required": ["answer"]}
    body = {
        "prompt": "Pick one.",
        "max_tokens": 48,
        "response_format": {"type": "json_schema", "json_schema": schema},
    }
    reply = httpx.post(f"{node.url}/accounts/acct/ai/run/glm45", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    jsonschema.validate(json.loads(reply.json()["result"]["response"]), schema)


@pytest.mark.parametrize(
    ("schema", "named"),
    [
        ({"type": "object", "properties": {"a": {"type": "strin"}}}, "strin"),
        ({"not": {"type": "string"}}, "not"),
    ],
)
def test_unsupported_schemas_are_400s_naming_the_problem(
    node: Any, client: openai.OpenAI, schema: dict, named: str
) -> None:
    response_format = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    with pytest.raises(openai.BadRequestError) as chat:
        client.chat.completions.create(model="llama3", messages=ASK, response_format=response_format)
    assert named in chat.value.message and chat.value.body["param"] == "response_format"
    wai = httpx.post(
        f"{node.url}/accounts/acct/ai/run/llama3",
        json={"prompt": "x", "response_format": {"type": "json_schema", "json_schema": schema}},
        timeout=60,
    )
    assert wai.status_code == 400 and named in json.dumps(wai.json()["errors"])
    bad_tool = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    with pytest.raises(openai.BadRequestError, match=named):
        client.chat.completions.create(model="llama3", messages=ASK, tools=bad_tool)


def _check_calls(calls: list[Any], names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.id and call.type == "function" and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("family", list(FAMILIES))
def test_tool_calls_round_trip_per_family(client: openai.OpenAI, family: str) -> None:
    forced = client.chat.completions.create(
        model=family,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=256,
        temperature=0.8,
        seed=2,
    )
    choice = forced.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    _check_calls(choice.message.tool_calls, {"get_weather", "get_time"})
    # streamed, one named function, no parallel calls: the SDK puts the call together from its deltas
    named = {"type": "function", "function": {"name": "get_weather"}}
    with client.chat.completions.stream(
        model=family, messages=ASK, tools=TOOLS, tool_choice=named, parallel_tool_calls=False,
        max_tokens=96, temperature=0,
    ) as stream:  # fmt: skip
        events = list(stream)
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls" and len(final.message.tool_calls) == 1
    _check_calls(final.message.tool_calls, {"get_weather"})
    pieces = [e for e in events if e.type == "tool_calls.function.arguments.delta"]
    assert "".join(p.arguments_delta for p in pieces) == final.message.tool_calls[0].function.arguments
    # the call and its result go back to the model: the family's template renders them
    call = final.message.tool_calls[0]
    function = {"name": call.function.name, "arguments": call.function.arguments}
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": call.id, "type": "function", "function": function}],
        },
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'},
    ]
    follow_up = client.chat.completions.create(
        model=family, messages=history, tools=TOOLS, max_tokens=8, temperature=0
    )
    assert follow_up.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_tool_choice_none_never_calls(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="qwen3", messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=16
    )
    assert reply.choices[0].message.tool_calls is None and reply.choices[0].finish_reason in (
        "stop",
        "length",
    )


def test_sdk_pydantic_tool_helper(client: openai.OpenAI) -> None:
    tool = openai.pydantic_function_tool(GetWeather)
    completion = client.chat.completions.parse(
        model="kimi_k2",
        messages=ASK,
        tools=[tool],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=128,
        temperature=0,
    )
    call = completion.choices[0].message.tool_calls[0]
    assert isinstance(call.function.parsed_arguments, GetWeather)


def test_fields_pass_through_an_upstream_member(upstream_node: str, node_factory: Any) -> None:
    """A node whose model is another edgeinfer passes response_format and tools on and the calls back."""
    node = node_factory({}, upstreams={"far": upstream_node + "/v1"})
    client = openai.OpenAI(base_url=node.url + "/v1", api_key="unused", max_retries=0)
    pick = {"type": "json_schema", "json_schema": {"name": "pick", "schema": {"enum": ["left", "right"]}}}
    answer = client.chat.completions.create(model="far", messages=ASK, response_format=pick, max_tokens=16)
    assert json.loads(answer.choices[0].message.content) in ("left", "right")
    for stream in (False, True):
        reply = client.chat.completions.create(
            model="far", messages=ASK, tools=TOOLS[1:], parallel_tool_calls=False, max_tokens=64,
            temperature=0, tool_choice={"type": "function", "function": {"name": "get_time"}}, stream=stream,
        )  # fmt: skip
        if stream:
            chunks = [c for c in reply if c.choices]
            calls = merge_call_deltas(
                [d.model_dump(exclude_none=True) for c in chunks for d in c.choices[0].delta.tool_calls or []]
            )
            calls = [openai.types.chat.ChatCompletionMessageToolCall.model_validate(c) for c in calls]
            finish = chunks[-1].choices[0].finish_reason
        else:
            calls, finish = reply.choices[0].message.tool_calls, reply.choices[0].finish_reason
        assert finish == "tool_calls" and [c.function.name for c in calls] == ["get_time"]
        assert json.loads(calls[0].function.arguments) == {}

"""Each family's tool-call parser on answers written in its documented format, the streaming split into
reasoning / content / calls (any chunking gives the whole answer's result), and the forcing grammars."""

from __future__ import annotations

import json

import pytest

from edgeinfer.structured.call_stream import merge_call_deltas
from edgeinfer.structured.formats import FORMATS, format_for
from edgeinfer.structured.grammar import lark_grammar
from edgeinfer.structured.stream import AnswerParser, Parts
from edgeinfer.structured.tools import Tool, ToolChoice, parse_tool_choice, parse_tools

WEATHER_ARGS = {"city": "Paris", "days": 2}
ANSWERS = {
    "json": '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}]}',
    "llama3": '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}',
    "qwen3": (
        'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}'
        "\n</tool_call>"
    ),
    "glm45": (
        "Let me look.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
        "<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>"
    ),
    "kimi_k2": (
        "Let me look.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        '<|tool_call_argument_begin|>{"city": "Paris", "days": 2}<|tool_call_end|><|tool_calls_section_end|>'
    ),
}
TOOLS = [
    Tool(
        "get_weather",
        "",
        {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}},
    ),
    Tool("get_time", "", {"type": "object", "properties": {}}),
]


@pytest.mark.parametrize("name", list(ANSWERS))
def test_parsers_read_their_family_format(name: str) -> None:
    content, calls = FORMATS[name].parse(ANSWERS[name])
    assert [c.name for c in calls] == ["get_weather"]
    assert json.loads(calls[0].arguments) == WEATHER_ARGS
    assert content == ("Let me look." if name in ("qwen3", "glm45", "kimi_k2") else "")
    if name == "kimi_k2":
        assert calls[0].id == "functions.get_weather:0"


@pytest.mark.parametrize("name", list(ANSWERS))
def test_text_without_calls_is_content(name: str) -> None:
    for text in ("It is sunny in Paris.", '{"not": "a call"}', "<tool_call>\n{broken\n</tool_call>"):
        assert FORMATS[name].parse(text) == (text, [])


def test_parallel_calls_are_all_parsed() -> None:
    one = '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>'
    two = one + '\n<tool_call>\n{"name": "b", "arguments": {"x": 1}}\n</tool_call>'
    assert [c.name for c in FORMATS["qwen3"].parse(two)[1]] == ["a", "b"]


@pytest.mark.parametrize("name", list(ANSWERS))
@pytest.mark.parametrize("chunk", [1, 3, 1000])
def test_streamed_answers_split_like_whole_ones(name: str, chunk: int) -> None:
    answer = "<think>Need the weather.</think>\n" + ANSWERS[name]
    parser = AnswerParser(FORMATS[name], reasoning=True)
    parts = [parser.feed(answer[i : i + chunk]) for i in range(0, len(answer), chunk)] + [parser.finish()]
    merged = Parts("".join(p.reasoning for p in parts), "".join(p.content for p in parts))
    calls = merge_call_deltas([c for p in parts for c in p.tool_calls])
    assert merged.reasoning == "Need the weather."
    assert merged.content == FORMATS[name].parse(ANSWERS[name])[0]
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [WEATHER_ARGS]


def test_reasoning_opened_by_the_prompt_and_plain_content() -> None:
    parser = AnswerParser(None, reasoning=True, in_reasoning=True)
    first, last = parser.feed("thinking...</thi"), parser.feed("nk>\n\nThe answer.")
    assert (first.reasoning + last.reasoning, first.content + last.content) == ("thinking...", "The answer.")
    plain = AnswerParser(FORMATS["qwen3"], reasoning=True)
    out = plain.feed("No tools <needed>.")
    assert out.content + plain.finish().content == "No tools <needed>."


@pytest.mark.parametrize("name", list(ANSWERS))
@pytest.mark.parametrize("parallel", [False, True])
def test_forcing_grammars_compile(name: str, parallel: bool) -> None:
    for choice in (ToolChoice("required"), ToolChoice("required", "get_time")):
        lark_grammar(FORMATS[name].grammar(TOOLS, choice, parallel, json.dumps))


def test_format_follows_the_model_config() -> None:
    has_kimi_token = lambda text: text == "<|tool_calls_section_begin|>"  # noqa: E731
    assert format_for("qwen3_moe", has_kimi_token).name == "qwen3"
    assert format_for("glm4_moe", has_kimi_token).name == "glm45"
    assert format_for("deepseek_v3", has_kimi_token).name == "kimi_k2"
    assert format_for("deepseek_v3", lambda text: False).name == "json"
    assert format_for("gemma3_text", has_kimi_token).name == "json"
    assert format_for("llama", has_kimi_token).name == "llama3"


@pytest.mark.parametrize(
    ("tools", "choice", "error"),
    [
        ([{"type": "function"}], None, r"tools\[0\]\.function must be an object"),
        ([{"type": "function", "function": {"name": "bad name"}}], None, "letters, digits"),
        ([{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}], None, "strin"),
        ([{"function": {"name": "f"}}, {"function": {"name": "f"}}], None, "unique"),
        ([{"function": {"name": "f"}}], {"type": "function", "function": {"name": "g"}}, "not in tools"),
        ([], "required", "needs tools"),
        ([{"function": {"name": "f"}}], "sometimes", "tool_choice must be"),
    ],
)
def test_bad_tools_are_named(tools: list, choice: object, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        parse_tool_choice(choice, parse_tools(tools))

"""Tool calls read as the answer streams: OpenAI deltas (the call's id and name, then pieces of its
arguments), whatever the chunking; a call that repeats an earlier one ends the answer and is not sent; an
answer cut by its token budget keeps the calls it completed."""

from __future__ import annotations

import json

import pytest

from edgeinfer.structured.call_stream import merge_call_deltas
from edgeinfer.structured.formats import FORMATS
from edgeinfer.structured.stream import AnswerParser

PARIS = ("get_weather", {"city": "Paris", "days": 2})
TOKYO = ("get_weather", {"city": "Tokyo", "days": 1})
TIME = ("get_time", {})


def _call_text(fmt: str, name: str, args: dict, index: int) -> str:
    body = json.dumps(args)
    if fmt == "json":
        return json.dumps({"name": name, "arguments": args})
    if fmt == "qwen3":
        return f'<tool_call>\n{{"name": "{name}", "arguments": {body}}}\n</tool_call>'
    if fmt == "glm45":
        pairs = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n" for k, v in args.items())
        return f"<tool_call>{name}\n{pairs}</tool_call>"
    return f"<|tool_call_begin|>functions.{name}:{index}<|tool_call_argument_begin|>{body}<|tool_call_end|>"


def _answer(fmt: str, calls: list[tuple[str, dict]]) -> str:
    texts = [_call_text(fmt, name, args, i) for i, (name, args) in enumerate(calls)]
    if fmt == "json":
        return '{"tool_calls": [' + ", ".join(texts) + "]}"
    if fmt == "kimi_k2":
        return "<|tool_calls_section_begin|>" + "".join(texts) + "<|tool_calls_section_end|>"
    return "\n".join(texts)


def _stream(fmt: str, text: str, chunk: int) -> tuple[AnswerParser, list[dict], str]:
    """Feed `text` in chunks until the parser asks to stop; (parser, delta items, content)."""
    parser = AnswerParser(FORMATS[fmt], reasoning=False)
    items: list[dict] = []
    content = ""
    for i in range(0, len(text), chunk):
        parts = parser.feed(text[i : i + chunk])
        items += parts.tool_calls
        content += parts.content
        if parser.repeated:
            break
    end = parser.finish()
    return parser, items + end.tool_calls, content + end.content


def _calls(items: list[dict]) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in merge_call_deltas(items)]


MULTI = ["json", "qwen3", "glm45", "kimi_k2"]


@pytest.mark.parametrize("fmt", MULTI)
@pytest.mark.parametrize("chunk", [1, 4, 10_000])
def test_calls_stream_as_openai_deltas(fmt: str, chunk: int) -> None:
    parser, items, content = _stream(fmt, _answer(fmt, [PARIS, TIME]), chunk)
    assert _calls(items) == [PARIS, TIME] and content == "" and not parser.repeated
    heads = [item for item in items if "id" in item]
    assert [(h["index"], h["function"]["name"], h["function"]["arguments"]) for h in heads] == [
        (0, "get_weather", ""),
        (1, "get_time", ""),
    ]
    assert len({h["id"] for h in heads}) == 2
    # after its head, a call's items carry only pieces of its arguments
    assert all(
        set(item) == {"index", "function"} and set(item["function"]) == {"arguments"}
        for item in items
        if "id" not in item
    )


@pytest.mark.parametrize("fmt", ["json", "qwen3", "kimi_k2"])
def test_arguments_stream_before_the_call_closes(fmt: str) -> None:
    text = _answer(fmt, [PARIS])
    cut = text.index("Par") + 3
    parser = AnswerParser(FORMATS[fmt], reasoning=False)
    items = parser.feed(text[:cut]).tool_calls
    sent = "".join(i["function"]["arguments"] for i in items)
    assert items[0]["function"]["name"] == "get_weather" and sent.endswith('"Par')


@pytest.mark.parametrize("fmt", MULTI)
@pytest.mark.parametrize("chunk", [1, 7, 10_000])
def test_a_repeated_call_ends_the_answer_unsent(fmt: str, chunk: int) -> None:
    text = _answer(fmt, [PARIS, TOKYO, PARIS, TIME, PARIS])
    parser, items, _ = _stream(fmt, text, chunk)
    assert parser.repeated
    assert _calls(items) == [PARIS, TOKYO]
    # nothing of the repeat was sent, not even its name
    assert [i["function"]["name"] for i in items if "id" in i] == ["get_weather", "get_weather"]


@pytest.mark.parametrize("fmt", MULTI)
def test_a_cut_answer_keeps_its_complete_calls(fmt: str) -> None:
    whole = _answer(fmt, [PARIS, TIME, TOKYO])
    cut = whole[: whole.index("Tokyo") + 2]
    parser, items, content = _stream(fmt, cut, 5)
    assert _calls(items) == [PARIS, TIME] and content == "" and not parser.repeated
    if fmt != "glm45":  # GLM's arguments are sent a whole value at a time: this one never was
        open_call = merge_call_deltas(items, complete_only=False)[-1]
        assert open_call["function"]["name"] == "get_weather" and "To" in open_call["function"]["arguments"]


def test_a_call_that_starts_like_an_earlier_one_is_sent_once_it_differs() -> None:
    other_days = ("get_weather", {"city": "Paris", "days": 3})
    parser, items, _ = _stream("json", _answer("json", [PARIS, other_days]), 1)
    assert _calls(items) == [PARIS, other_days] and not parser.repeated


def test_arguments_written_as_a_json_string_are_decoded() -> None:
    text = '{"tool_calls": [{"name": "f", "arguments": "{\\"a\\": [1, 2]}"}]}'
    assert _calls(_stream("json", text, 3)[1]) == [("f", {"a": [1, 2]})]


def test_arguments_before_the_name_wait_for_it() -> None:
    text = '<tool_call>\n{"arguments": {"x": 1}, "name": "b"}\n</tool_call>'
    assert _calls(_stream("qwen3", text, 2)[1]) == [("b", {"x": 1})]


@pytest.mark.parametrize("text", ['{"answer": 42}', '{"tool_calls": "none"}', "{not json at all"])
def test_json_that_holds_no_call_is_content(text: str) -> None:
    _, items, content = _stream("json", text, 3)
    assert items == [] and content == text

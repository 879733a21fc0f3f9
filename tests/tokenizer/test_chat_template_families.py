"""Checkpoint chat templates render in our sandbox exactly as transformers' `apply_chat_template` renders
them, token for token: each family's documented format (templates/*.jinja, written for these tests) with
and without tools, system messages, tool results, multi-turn and parallel tool calls, reasoning."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from helpers.structured_models import json_tokenizer_builder
from transformers import PreTrainedTokenizerFast

from edgeinfer.engine.chat_messages import normalize_messages
from edgeinfer.engine.tokenizer import Tokenizer
from edgeinfer.structured.prompt import json_form_messages

TEMPLATES = Path(__file__).parent / "templates"
MODEL_TYPES = {
    "llama3": "llama",
    "qwen3": "qwen3",
    "glm45": "glm4_moe",
    "kimi_k2": "kimi_k2",
    "gemma3": "gemma3_text",
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
}
TOOLS = [WEATHER, TIME]


def _call(call_id: str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    # OpenAI clients send arguments as JSON text; templates get them as an object
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


PARIS = _call("functions.get_weather:0", "get_weather", {"city": "Paris"})
PARIS_2 = _call("functions.get_weather:0", "get_weather", {"city": "Paris", "days": 2})

CHATS: dict[str, list[dict[str, Any]]] = {
    "plain": [{"role": "user", "content": "Hello!"}],
    "system_multi_turn": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Weather?"},
    ],
    "tool_result": [
        {"role": "system", "content": "You help with weather."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [PARIS]},
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": '{"temp": 21}'},
    ],
    "multi_turn_calls": [
        {"role": "user", "content": "Weather in Paris for 2 days?"},
        {"role": "assistant", "content": "", "tool_calls": [PARIS_2]},
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "sunny"},
        {"role": "assistant", "content": "Sunny in Paris.", "reasoning_content": "The tool said sunny."},
        {"role": "user", "content": "And the time?"},
        {"role": "assistant", "content": None, "tool_calls": [_call("functions.get_time:1", "get_time", {})]},
        {"role": "tool", "tool_call_id": "functions.get_time:1", "content": "12:00"},
    ],
    "parallel_calls": [
        {"role": "user", "content": "Weather in Paris and Oslo?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                _call("functions.get_weather:0", "get_weather", {"city": "Paris"}),
                _call("functions.get_weather:1", "get_weather", {"city": "Oslo"}),
            ],
        },
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "rain"},
        {"role": "tool", "tool_call_id": "functions.get_weather:1", "content": "snow"},
    ],
}  # fmt: skip
NATIVE = ("llama3", "qwen3", "glm45", "kimi_k2")


@pytest.fixture(scope="module")
def hf_base(tmp_path_factory: pytest.TempPathFactory) -> PreTrainedTokenizerFast:
    return json_tokenizer_builder()(tmp_path_factory.mktemp("template-tok"))


def _tokenizer(hf_base: PreTrainedTokenizerFast, family: str) -> Tokenizer:
    hf = copy.deepcopy(hf_base)
    hf.chat_template = (TEMPLATES / f"{family}.jinja").read_text()
    return Tokenizer(hf, MODEL_TYPES[family])


def _assert_same(tok: Tokenizer, ours: str, reference: str) -> None:
    assert ours == reference
    assert tok.encode(ours, add_special_tokens=False) == tok.hf.encode(reference, add_special_tokens=False)


@pytest.mark.parametrize("family", NATIVE)
@pytest.mark.parametrize("chat", list(CHATS))
@pytest.mark.parametrize("with_tools", [False, True])
def test_native_templates_match_transformers(
    hf_base: PreTrainedTokenizerFast, family: str, chat: str, with_tools: bool
) -> None:
    tok = _tokenizer(hf_base, family)
    tools = TOOLS if with_tools else None
    messages = normalize_messages(CHATS[chat])
    if family == "llama3" and chat == "parallel_calls":  # the template's own raise_exception
        with pytest.raises(ValueError, match="one tool call per assistant turn"):
            tok.apply_chat_template(CHATS[chat], tools=tools)
        return
    ours = tok.apply_chat_template(CHATS[chat], tools=tools)
    reference = tok.hf.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    _assert_same(tok, ours, reference)


@pytest.mark.parametrize("chat", ["plain", "system_multi_turn"])
def test_gemma_template_matches_transformers(hf_base: PreTrainedTokenizerFast, chat: str) -> None:
    tok = _tokenizer(hf_base, "gemma3")
    messages = normalize_messages(CHATS[chat])
    reference = tok.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    _assert_same(tok, tok.apply_chat_template(CHATS[chat]), reference)


@pytest.mark.parametrize("chat", ["tool_result", "multi_turn_calls", "parallel_calls"])
def test_gemma_gets_tools_in_the_json_form(hf_base: PreTrainedTokenizerFast, chat: str) -> None:
    """Gemma's template has no place for tools: they, the calls and the results become plain turns."""
    tok = _tokenizer(hf_base, "gemma3")
    plain = json_form_messages(normalize_messages(CHATS[chat]), TOOLS)
    reference = tok.hf.apply_chat_template(plain, tokenize=False, add_generation_prompt=True)
    ours = tok.apply_chat_template(CHATS[chat], tools=TOOLS)
    _assert_same(tok, ours, reference)
    assert '"name": "get_weather"' in ours and '{"tool_calls": [{"name": "get_weather"' in ours
    assert "Tool result (functions.get_weather:0)" in ours


def test_template_kwargs_reach_the_template(hf_base: PreTrainedTokenizerFast) -> None:
    tok = _tokenizer(hf_base, "qwen3")
    off = tok.apply_chat_template(CHATS["plain"], template_kwargs={"enable_thinking": False})
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert tok.apply_chat_template(CHATS["plain"]).endswith("<|im_start|>assistant\n")
    # a client's kwargs cannot replace the conversation or the special tokens
    clash = {"messages": [], "add_generation_prompt": False, "eos_token": "EVIL"}
    assert tok.apply_chat_template(CHATS["plain"], template_kwargs=clash) == tok.apply_chat_template(
        CHATS["plain"]
    )


@pytest.mark.parametrize(
    "template",
    [
        "{{ messages.__class__.__mro__ }}",
        "{{ ''.__class__.__subclasses__() }}",
        "{% set ns = namespace() %}{% set ns.__dict__ = 1 %}",
        "{{ messages.append(1) }}",
    ],
)
def test_templates_run_sandboxed(hf_base: PreTrainedTokenizerFast, template: str) -> None:
    hf = copy.deepcopy(hf_base)
    hf.chat_template = template
    with pytest.raises(ValueError, match="chat template rejected"):
        Tokenizer(hf, "llama").apply_chat_template(CHATS["plain"])

"""Chat prompts: message validation, Gemma's turn format, the generic fallback, and checkpoint templates."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from tokenizer_files import write_bpe_checkpoint

from edgeinfer.engine.chat_messages import normalize_messages
from edgeinfer.engine.chat_templates import gemma_chat, generic_chat
from edgeinfer.engine.model.loader import open_checkpoint
from edgeinfer.engine.tokenizer import Tokenizer

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "  Hi!  "},
    {"role": "assistant", "content": [{"type": "text", "text": "Hello."}, {"type": "text", "text": "How?"}]},
    {"role": "user", "content": "Tell me a joke."},
]


def test_normalizes_content_parts() -> None:
    messages = normalize_messages(CONVERSATION)
    assert messages[2] == {"role": "assistant", "content": "Hello.\nHow?"}
    assert all(set(m) == {"role", "content"} for m in messages)


@pytest.mark.parametrize(
    ("messages", "error"),
    [
        ([], "non-empty list"),
        ("hello", "non-empty list"),
        (["hello"], r"messages\[0\] must be an object"),
        ([{"role": "robot", "content": "x"}], r"role must be one of system, user, assistant, tool"),
        ([{"role": "user"}], r"messages\[0\]\.content must be a string or a list of text parts"),
        ([{"role": "user", "content": 3}], r"messages\[0\]\.content must be"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], r"content\[0\] must be"),
        ([{"role": "user", "content": [{"type": "text"}]}], r"content\[0\] must be"),
    ],
)
def test_rejects_bad_messages(messages: Any, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        normalize_messages(messages)


def test_gemma_turn_format() -> None:
    prompt = gemma_chat(normalize_messages(CONVERSATION), True, "<bos>")
    assert prompt == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi!<end_of_turn>\n"
        "<start_of_turn>model\nHello.\nHow?<end_of_turn>\n"
        "<start_of_turn>user\nTell me a joke.<end_of_turn>\n"
        "<start_of_turn>model\n"
    )
    plain = gemma_chat(normalize_messages([{"role": "user", "content": "x"}]), False, "<bos>")
    assert plain == "<bos><start_of_turn>user\nx<end_of_turn>\n"


@pytest.mark.parametrize(
    ("roles", "error"),
    [
        (["system"], "at least one user message"),
        (["assistant"], "turn 0 is 'assistant'"),
        (["user", "user"], "turn 1 is 'user'"),
        (["user", "assistant", "system"], "turn 2 is 'system'"),
    ],
)
def test_gemma_turn_order(roles: list[str], error: str) -> None:
    messages = normalize_messages([{"role": role, "content": "x"} for role in roles])
    with pytest.raises(ValueError, match=error):
        gemma_chat(messages, True, "<bos>")


def test_generic_format() -> None:
    prompt = generic_chat(normalize_messages(CONVERSATION[:2]), True, "<s>")
    assert prompt == "System: Be brief.\n\nUser: Hi!\n\nAssistant:"


def test_builtin_template_follows_model_type(bpe_tokenizer: Tokenizer) -> None:
    assert bpe_tokenizer.hf.chat_template is None
    messages = [{"role": "user", "content": "Hi"}]
    assert bpe_tokenizer.apply_chat_template(messages) == "User: Hi\n\nAssistant:"
    as_gemma = Tokenizer(bpe_tokenizer.hf, model_type="gemma3_text")
    assert (
        as_gemma.apply_chat_template(messages)
        == "<s><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
    )


TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}"
    "[{{ m['role'] }}]{{ m['content'] }}<eot>{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"
)


def test_checkpoint_template_wins(tmp_path: Path) -> None:
    tokenizer = Tokenizer.from_checkpoint(
        open_checkpoint(write_bpe_checkpoint(tmp_path, chat_template=TEMPLATE))
    )
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert tokenizer.apply_chat_template(messages) == "[user]a\nb<eot>[assistant]"
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=False) == "[user]a\nb<eot>"
    with pytest.raises(ValueError, match="chat template rejected the messages: no system role"):
        tokenizer.apply_chat_template(CONVERSATION)


@pytest.mark.gemma
def test_gemma_prompt_tokens(gemma_tokenizer: Tokenizer) -> None:
    prompt = gemma_tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    ids = gemma_tokenizer.encode(prompt)
    # <bos> <start_of_turn> user \n Hi <end_of_turn> \n <start_of_turn> model \n: one BOS, turns whole.
    assert ids[:4] == [2, 105, 2364, 107] and ids.count(2) == 1
    assert ids[-5:] == [106, 107, 105, 4368, 107]

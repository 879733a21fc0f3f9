"""Chat prompts: validating messages, the checkpoint's own template when it has one, built-in formats else.

Messages are normalized before any template sees them: content becomes one string (text parts joined by a
newline), so every template, ours or the checkpoint's, gets the same shape whatever the client sent.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from jinja2 import TemplateError

ROLES = ("system", "user", "assistant")

Message = dict[str, str]


def normalize_messages(messages: Any) -> list[Message]:
    """Validate OpenAI-style chat messages into `[{"role", "content": str}]`; bad input raises ValueError."""
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
    return {"role": role, "content": _content_text(index, message.get("content"))}


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


def render_with_checkpoint_template(
    hf_tokenizer: Any, messages: list[Message], add_generation_prompt: bool
) -> str:
    """Render with the checkpoint's own jinja template (transformers' sandboxed renderer)."""
    try:
        return hf_tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except TemplateError as exc:  # the template's own raise_exception(), e.g. roles not alternating
        raise ValueError(f"chat template rejected the messages: {exc}") from exc


def gemma_chat(messages: list[Message], add_generation_prompt: bool, bos_token: str) -> str:
    """Gemma's turn format, as Google's template writes it.

    `<bos><start_of_turn>user\\n{system}\\n\\n{text}<end_of_turn>\\n<start_of_turn>model\\n...`: Gemma has no
    system role, so a leading system message is folded into the first user turn; turns must alternate
    user/assistant starting with user; the assistant's role is called `model`; message text is stripped.
    """
    prefix, turns = _split_system(messages)
    if not turns:
        raise ValueError("Gemma chat needs at least one user message after the system message")
    parts = [bos_token]
    for i, message in enumerate(turns):
        expected = "user" if i % 2 == 0 else "assistant"
        if message["role"] != expected:
            got = message["role"]
            raise ValueError(f"Gemma chat needs alternating user/assistant turns; turn {i} is {got!r}")
        role = "model" if message["role"] == "assistant" else "user"
        text = (prefix if i == 0 else "") + message["content"].strip()
        parts.append(f"<start_of_turn>{role}\n{text}<end_of_turn>\n")
    if add_generation_prompt:
        parts.append("<start_of_turn>model\n")
    return "".join(parts)


def _split_system(messages: list[Message]) -> tuple[str, list[Message]]:
    if messages[0]["role"] == "system":
        return messages[0]["content"] + "\n\n", messages[1:]
    return "", messages


def generic_chat(messages: list[Message], add_generation_prompt: bool, bos_token: str) -> str:
    """A plain-text transcript for models without a template: `System: ...`, `User: ...`, `Assistant: ...`.

    No special tokens: the vocabulary may have none for chat. BOS is left to `encode`.
    """
    lines = [f"{message['role'].capitalize()}: {message['content'].strip()}\n\n" for message in messages]
    if add_generation_prompt:
        lines.append("Assistant:")
    return "".join(lines)


BuiltinTemplate = Callable[[list[Message], bool, str], str]

_BUILTIN: dict[str, BuiltinTemplate] = {"gemma": gemma_chat, "generic": generic_chat}


def builtin_template(model_type: str | None) -> BuiltinTemplate:
    """The built-in format for a model family (by HF `model_type`)."""
    family = "gemma" if model_type and model_type.startswith("gemma") else "generic"
    return _BUILTIN[family]

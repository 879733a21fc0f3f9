"""Chat prompts: the checkpoint's own Jinja template, rendered in a sandbox, or a built-in format for
checkpoints without one.

Templates come with downloaded checkpoints and are untrusted code: they run in Jinja's immutable sandbox
(no attribute access to internals, no mutation of the inputs), with the same environment transformers
gives them — `trim_blocks`, `lstrip_blocks`, loop controls, a `tojson` that does not escape HTML, and the
globals `raise_exception`, `strftime_now`, `namespace` and `dict` — so a template renders here exactly as
`apply_chat_template` renders it.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from edgeinfer.engine.chat_messages import Message

TEMPLATE_ERRORS = (jinja2.TemplateError,)


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (marks trainable assistant text in some templates): the
    body renders unchanged."""

    tags = {"generation"}  # noqa: RUF012 (jinja's declared class attribute)

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Callable[[], str]) -> str:
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """`namespace()` whose attributes cannot be dunder names (no route to interpreter internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"templates may not set attribute {name!r}")


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


@functools.lru_cache(maxsize=16)
def compile_template(text: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals.update(
        raise_exception=_raise,
        strftime_now=lambda fmt: datetime.now().strftime(fmt),
        namespace=_Namespace,
        dict=lambda *a, **k: dict(*a, **k),
    )
    return env.from_string(text)


def render_template(
    text: str,
    messages: list[Message],
    *,
    tools: list[dict[str, Any]] | None,
    add_generation_prompt: bool,
    special_tokens: dict[str, str],
    extra: dict[str, Any] | None = None,
) -> str:
    """Render a chat template; a template that rejects the messages (its `raise_exception`) or fails to
    parse raises ValueError."""
    reserved = {"messages", "tools", "documents", "add_generation_prompt", *special_tokens}
    variables = {**{k: v for k, v in (extra or {}).items() if k not in reserved}, **special_tokens}
    try:
        return compile_template(text).render(
            messages=messages,
            tools=tools,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **variables,
        )
    except jinja2.TemplateError as exc:
        raise ValueError(f"chat template rejected the messages: {exc}") from exc


def handles_tools(text: str) -> bool:
    """Whether a template writes tool definitions itself (else tools go into a system preamble)."""
    return "tools" in text


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

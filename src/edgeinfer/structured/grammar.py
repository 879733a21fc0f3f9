"""Grammars for llguidance from JSON schemas, `response_format` bodies and Lark text, validated up front.

A grammar is llguidance's own serialized form (a string), so it crosses the node → engine door inside
`SamplingParams` as plain data; the engine compiles it against its tokenizer.

JSON is constrained to one layout: `{"a": 1, "b": [2, 3]}` (", " and ": " separators, no other whitespace).
Free whitespace lets a model pad forever between tokens (a known failure of constrained decoding), and a
fixed layout keeps the output short and predictable; JSON readers do not care.
"""

from __future__ import annotations

import json
from typing import Any

import llguidance

from edgeinfer.types import bounded_json

JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Any JSON object: what `{"type": "json_object"}` asks for.
ANY_OBJECT: dict[str, Any] = {"type": "object"}


class GrammarError(ValueError):
    """A schema or grammar the library cannot compile; the message names the problem."""


def json_schema_grammar(schema: Any) -> str:
    """The grammar of JSON documents valid under `schema` (a dict, or True for any JSON value)."""
    if not isinstance(schema, dict | bool):
        raise GrammarError(f"a JSON schema must be an object, got {type(schema).__name__}")
    if schema is False:
        raise GrammarError("the JSON schema false admits no document")
    if schema is True:
        schema = {}  # the same: any JSON value (llguidance takes object schemas only)
    try:
        # As text: llguidance's parser bounds the nesting (an error), where converting a dict recurses
        # natively, which a deep enough schema overflows.
        text = json.dumps(schema)
    except (TypeError, ValueError, RecursionError):
        raise GrammarError("invalid JSON schema: not JSON, or nested too deeply") from None
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(text, defaults=JSON_OPTIONS)
    except ValueError as exc:
        raise GrammarError(f"invalid JSON schema: {exc}") from None
    return checked(grammar, "JSON schema")


def inline_json(schema: dict[str, Any]) -> str:
    """A schema inlined in Lark (`%json {...}`), with our JSON layout (its `x-guidance` options)."""
    return f"%json {json.dumps({**schema, 'x-guidance': JSON_OPTIONS})}"


def lark_grammar(text: str) -> str:
    """The grammar of a Lark text (llguidance's dialect: `%json {...}` inlines a schema, `<[id]>` a token)."""
    return checked(llguidance.LLMatcher.grammar_from_lark(text), "grammar")


def checked(grammar: str, what: str) -> str:
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise GrammarError(f"unsupported {what}: {_first_line(messages[0])}")
    return grammar


def response_format_grammar(response_format: Any) -> str | None:
    """The grammar of an OpenAI or Workers-AI `response_format`; None for plain text.

    OpenAI nests the schema as `json_schema.schema` (beside `name` and `strict`); Workers AI sends the
    schema itself as `json_schema`. Both spellings are accepted on both APIs.
    """
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise GrammarError("response_format must be an object with a `type`")
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return json_schema_grammar(ANY_OBJECT)
    if kind == "json_schema":
        return json_schema_grammar(_schema_of(response_format.get("json_schema")))
    raise GrammarError(f"response_format type must be text, json_object or json_schema, got {kind!r}")


def _schema_of(spec: Any) -> Any:
    if isinstance(spec, str):  # some clients send the schema as JSON text
        try:
            spec = bounded_json.loads(spec)
        except ValueError as exc:
            raise GrammarError(f"json_schema is not valid JSON: {exc}") from None
    if not isinstance(spec, dict):
        raise GrammarError("response_format.json_schema must be an object")
    if "schema" in spec:
        # OpenAI's nesting: the schema is this field. Anything but a schema (an object, or true / false)
        # is an error; read as the Workers-AI spelling instead, it would be unknown keywords that
        # constrain nothing.
        if not isinstance(spec["schema"], dict | bool):
            kind = "null" if spec["schema"] is None else type(spec["schema"]).__name__
            raise GrammarError(f"json_schema.schema must be a JSON schema (an object or true), got {kind}")
        return spec["schema"]
    if set(spec) <= {"name", "description", "strict"}:
        return ANY_OBJECT  # OpenAI's json_schema without a schema: any JSON object
    return spec


def _first_line(message: str) -> str:
    return " ".join(part.strip() for part in message.strip().splitlines() if part.strip())

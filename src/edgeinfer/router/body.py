"""A request body as the node reads it, in one parse: FastAPI's rules for which bodies are JSON, the bounded
JSON reading (types/bounded_json.py) and the node's schemas, so that a body the node would refuse gets the
node's 4xx here and never reaches a node.

orjson reads the body; what it refuses is read again by the standard library's parser, which the node
uses: it accepts a little more (NaN, integers beyond 64 bits, escaped lone surrogates) and words the error."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, TypeVar

import orjson
from pydantic import BaseModel, ValidationError

from edgeinfer.api.errors import ApiError, bad_request
from edgeinfer.router.wire import Request
from edgeinfer.types import bounded_json
from edgeinfer.types.validation import InvalidInput

Model = TypeVar("Model", bound=BaseModel)
# Where a validation error's location starts with the request part, as FastAPI reports it.
_SOURCES = ("body", "query", "path", "header", "cookie")


class _Missing:
    """No body at all."""


MISSING = _Missing()


def json_value(request: Request) -> Any:
    """The body's JSON value; the raw bytes where the content type is not JSON (the schema then refuses
    them, as on the node); MISSING for an empty body. 400 for a body that is not JSON or nests too deep."""
    if not request.body:
        return MISSING
    if not _is_json(request.header(b"content-type")):
        return request.body
    try:
        value = orjson.loads(request.body)
    except orjson.JSONDecodeError:
        return _stdlib_value(request.body)
    if bounded_json.nesting_depth(value, bounded_json.MAX_JSON_DEPTH) > bounded_json.MAX_JSON_DEPTH:
        raise bad_request(f"invalid JSON body: {bounded_json.too_deep().msg}")
    return value


def _stdlib_value(body: bytes) -> Any:
    try:
        return bounded_json.loads(body)
    except json.JSONDecodeError as exc:
        raise bad_request(f"invalid JSON body: {exc.msg}") from None


def _is_json(content_type: bytes | None) -> bool:
    """application/json or application/*+json, parameters aside (FastAPI's strict content type)."""
    if content_type is None:
        return False
    kind = content_type.split(b";", 1)[0].strip().lower()
    main, _, sub = kind.partition(b"/")
    return main == b"application" and (sub == b"json" or sub.endswith(b"+json"))


def validated(schema: type[Model], value: Any) -> Model:
    """`value` as `schema`; the node's 400 (the first bad field in `param`) otherwise."""
    if value is MISSING:
        raise bad_request("body: Field required", param="body")
    try:
        return schema.model_validate(value, from_attributes=True)
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None


def validation_error(errors: Sequence[Any]) -> ApiError:
    """As the node words it (api/http/error_handlers.py): the first error, and how many more."""
    first = errors[0]
    where = _field(first["loc"])
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    own = first.get("ctx", {}).get("error")
    message = str(own) if isinstance(own, InvalidInput) else f"{where}: {first['msg']}"
    return bad_request(f"{message}{more}", param=where)


def _field(loc: Sequence[Any]) -> str:
    parts = list(loc[1:] if loc and loc[0] in _SOURCES else loc)
    return ".".join(str(part) for part in parts) or "body"

"""/openapi.json as the node answers: every status a route can return with its error body (OpenAI's shape on
/v1 and the ops routes, the Workers-AI envelope on /ai/run), and bearer auth optional on an open node."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from edgeinfer.api.errors import is_workers_ai_path
from edgeinfer.api.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    WorkersAIRunRequest,
)
from edgeinfer.types.bounded_json import MAX_JSON_DEPTH

# The request bodies, whose definitions are taken from pydantic again (`_exact_bodies`).
_BODIES = (CompletionRequest, ChatCompletionRequest, EmbeddingRequest, WorkersAIRunRequest)
_REF = "#/components/schemas/{model}"


class OpenAIErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class OpenAIError(BaseModel):
    """OpenAI's error body."""

    error: OpenAIErrorDetail


class WorkersAIErrorItem(BaseModel):
    code: int
    message: str


class WorkersAIError(BaseModel):
    """The Workers-AI envelope of a failed run."""

    result: None
    success: bool
    errors: list[WorkersAIErrorItem]
    messages: list[Any]


_REASONS = {
    400: (
        f"Invalid JSON (or nested deeper than {MAX_JSON_DEPTH} levels), a field with a wrong type or value "
        "(`param` names it), or a request the model cannot serve (too long, bad token ids)"
    ),
    401: "Missing or wrong API key",
    403: "Not signed by a router",
    404: "Unknown model",
    405: "Method not allowed (the Allow header lists the route's methods)",
    408: "The request body did not arrive in time",
    413: "Body or input over a limit (the message names it)",
    429: "Rate limit or queue full (Retry-After says when to retry)",
    500: "Internal error (the message names the request id)",
    503: "Model loading or the node not ready (Retry-After)",
}
# Every route: the middleware answers 408 / 413 while reading a body and 500 for a bug; the router 405.
_ANY = (405, 408, 413, 500)
_MODEL_RUN = (400, 401, 404, 429, 503, *_ANY)
_FINETUNES = (400, 401, 404, 503, *_ANY)  # 503: the fleet's store (NATS) out of reach
_STATUSES: dict[tuple[str, str], tuple[int, ...]] = {
    ("post", "/v1/completions"): _MODEL_RUN,
    ("post", "/v1/chat/completions"): _MODEL_RUN,
    ("post", "/v1/embeddings"): _MODEL_RUN,
    ("post", "/accounts/{account_id}/ai/run/{model}"): _MODEL_RUN,
    ("get", "/v1/models"): (401, *_ANY),
    ("get", "/v1/usage"): (400, 401, *_ANY),
    ("get", "/ready"): (503, *_ANY),
    ("post", "/node/prefetch"): (400, 403, 404, *_ANY),
    ("post", "/accounts/{account_id}/ai/finetunes"): _FINETUNES,
    ("get", "/accounts/{account_id}/ai/finetunes"): _FINETUNES,
    ("post", "/accounts/{account_id}/ai/finetunes/{finetune_id}/finetune-assets"): _FINETUNES,
}
# Generation routes answer `stream: true` with server-sent events. Open API 3.1 has no schema for a stream,
# so `schema` describes one event, as readers of 3.1 (schemathesis among them) take it.
_STREAMING = (
    ("post", "/v1/completions"),
    ("post", "/v1/chat/completions"),
    ("post", "/accounts/{account_id}/ai/run/{model}"),
)
_EVENT_STREAM = {
    "schema": {
        "type": "object",
        "description": "With `stream: true`, one server-sent event",
        "properties": {"data": {"type": "string", "description": "one JSON chunk; the last event: [DONE]"}},
        "required": ["data"],
    }
}


def install(app: FastAPI, open_node: bool) -> None:
    """Replace `app.openapi` with the patched schema (built once, on first request)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title, version=app.version, description=app.description, routes=app.routes
            )
            _exact_bodies(schema)
            _declare_streams(schema)
            _declare_errors(schema)
            if open_node:
                _optional_auth(schema)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _exact_bodies(schema: dict[str, Any]) -> None:
    """FastAPI passes the schema through its OpenAPI model, which holds every bound as a float: the seed's
    maximum 2**64 - 1 came out as 1.8446744073709552e19 (= 2**64), and every integer's minimum as 1.0.
    The request bodies' definitions, as pydantic writes them, replace what came through it."""
    _add_definitions(schema, _BODIES)


def _add_definitions(schema: dict[str, Any], models: tuple[type[BaseModel], ...]) -> None:
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for model in models:
        definition = model.model_json_schema(ref_template=_REF)
        components.update(definition.pop("$defs", {}))
        components[model.__name__] = definition


def _declare_streams(schema: dict[str, Any]) -> None:
    for method, path in _STREAMING:
        ok = schema["paths"][path][method]["responses"]["200"]
        ok.setdefault("content", {})["text/event-stream"] = _EVENT_STREAM


def _declare_errors(schema: dict[str, Any]) -> None:
    _add_definitions(schema, (OpenAIError, WorkersAIError))
    for path, operations in schema.get("paths", {}).items():
        body = "WorkersAIError" if is_workers_ai_path(path.replace("{account_id}", "a")) else "OpenAIError"
        for method, operation in operations.items():
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)  # FastAPI's validation error, which is a 400 here (error_handlers.py)
            for status in _STATUSES.get((method, path), _ANY):
                content = {"application/json": {"schema": {"$ref": _REF.format(model=body)}}}
                responses[str(status)] = {"description": _REASONS[status], "content": content}
    components = schema["components"]["schemas"]
    components.pop("HTTPValidationError", None)
    components.pop("ValidationError", None)


def _optional_auth(schema: dict[str, Any]) -> None:
    """An open node (no tenants file) checks no key: a request without one is as valid as one with."""
    for operations in schema.get("paths", {}).values():
        for operation in operations.values():
            if operation.get("security"):
                operation["security"] = [{}, *operation["security"]]

"""Embedding requests: OpenAI `/v1/embeddings` and Workers-AI `{"text": ...}` bodies → `EmbeddingJob`,
with the server's limits (nodes and routers alike)."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from edgeinfer.api.errors import bad_request
from edgeinfer.api.limits import NodeLimits
from edgeinfer.api.schemas import EmbeddingRequest, WorkersAIRunRequest
from edgeinfer.types.request import Lane
from edgeinfer.types.validation import InvalidInput, check_some_inputs


@dataclass(kw_only=True)
class EmbeddingJob:
    """One embeddings request. `inputs` are texts (truncated to the model's maximum length, as
    sentence-transformers does) or token ids (used as given, so they must fit)."""

    request_id: str
    endpoint: str
    model: str
    inputs: list[str] | list[list[int]]
    arrival: float
    dimensions: int | None = None
    encoding_format: str = "float"
    reject_if_busy: bool = False
    param: str = "input"  # the body field the inputs came in, named by error messages
    lane: Lane = Lane.INTERACTIVE  # batch: a queued entry (the Batch API), metered at the batch price


def openai_embedding_job(body: EmbeddingRequest, limits: NodeLimits) -> EmbeddingJob:
    raw = body.input
    inputs: list[str] | list[list[int]]
    if isinstance(raw, str):
        inputs = [raw]
    elif raw and all(isinstance(x, int) for x in raw):
        inputs = [list(raw)]  # type: ignore[arg-type]
    else:
        inputs = list(raw)  # type: ignore[arg-type]
    _check_inputs(inputs, limits, "input")
    return EmbeddingJob(
        request_id=f"emb-{uuid.uuid4().hex}",
        endpoint="embeddings",
        model=body.model,
        inputs=inputs,
        arrival=time.monotonic(),
        dimensions=body.dimensions,
        encoding_format=body.encoding_format,
        reject_if_busy=bool(body.options and body.options.reject_if_busy),
    )


def workers_ai_embedding_job(model: str, body: WorkersAIRunRequest, limits: NodeLimits) -> EmbeddingJob:
    if body.text is None:
        raise bad_request(
            f"model {model} is a text-embeddings model: send `text` (a string or a list)", "text"
        )
    inputs = [body.text] if isinstance(body.text, str) else list(body.text)
    _check_inputs(inputs, limits, "text")
    return EmbeddingJob(
        request_id=f"wai-{uuid.uuid4().hex}",
        endpoint="ai.run",
        model=model,
        inputs=inputs,
        arrival=time.monotonic(),
        reject_if_busy=bool(body.options and body.options.reject_if_busy),
        param="text",
    )


def _check_inputs(inputs: list[str] | list[list[int]], limits: NodeLimits, param: str) -> None:
    """Some inputs, the server's limit and empty texts; what the model can embed is checked on the token ids
    (token_ids, with the engine's own check)."""
    try:
        check_some_inputs(inputs, param)
    except InvalidInput as exc:
        raise bad_request(str(exc), exc.param) from None
    if len(inputs) > limits.max_embedding_inputs:
        raise bad_request(
            f"`{param}` has {len(inputs)} items, above this server's limit of "
            f"{limits.max_embedding_inputs} inputs per request",
            param,
        )
    for i, item in enumerate(inputs):
        if isinstance(item, str) and not item:
            raise bad_request(f"`{param}[{i}]` is an empty string; every input needs text", param)

"""Embedding requests: OpenAI `/v1/embeddings` and Workers-AI `{"text": ...}` bodies → `EmbeddingJob`,
inputs → token ids (with the limits), vectors → either API's response."""

from __future__ import annotations

import base64
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson
from fastapi.responses import JSONResponse

from edgeinfer.node.config import NodeLimits
from edgeinfer.node.errors import ApiError, bad_request
from edgeinfer.node.schemas import EmbeddingRequest, WorkersAIRunRequest
from edgeinfer.types import Usage
from edgeinfer.types.validation import InvalidInput, check_embedding_inputs, check_some_inputs


@dataclass
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


def token_ids(
    job: EmbeddingJob,
    tokenize: Callable[[Sequence[str]], list[list[int]]],
    max_seq_length: int,
    vocab_size: int,
    limits: NodeLimits,
) -> list[list[int]]:
    """Texts tokenized (truncated to `max_seq_length`); token-id inputs checked against the model."""
    texts = [x for x in job.inputs if isinstance(x, str)]
    if texts and len(texts) != len(job.inputs):
        raise bad_request(f"`{job.param}` mixes strings and token ids", job.param)
    ids = tokenize(texts) if texts else [list(x) for x in job.inputs]  # type: ignore[arg-type]
    try:
        check_embedding_inputs(ids, vocab_size, max_seq_length, job.param)
    except InvalidInput as exc:
        raise bad_request(str(exc), exc.param) from None
    total = sum(len(seq) for seq in ids)
    if total > limits.max_prompt_tokens:
        raise bad_request(
            f"the inputs have {total} tokens together, above this server's limit of "
            f"{limits.max_prompt_tokens} tokens per request",
            "input",
        )
    return ids


def shorten(vectors: np.ndarray, dimensions: int | None, normalized: bool) -> np.ndarray:
    """The first `dimensions` components (as OpenAI's `dimensions`), re-normalised when the model's
    vectors are unit length, so cosine similarity keeps working."""
    if dimensions is None or dimensions == vectors.shape[1]:
        return vectors
    if dimensions > vectors.shape[1]:
        raise bad_request(
            f"dimensions {dimensions} is above this model's {vectors.shape[1]} dimensions", "dimensions"
        )
    short = vectors[:, :dimensions]
    if not normalized:
        return short
    return short / np.maximum(np.linalg.norm(short, axis=1, keepdims=True), 1e-12)


class VectorsResponse(JSONResponse):
    """JSON whose numpy arrays orjson writes itself: each float32 in its shortest form that reads back to
    the same float32 (9 digits at most, not float64's 17), ~20x faster than `json` over `tolist()`
    (which took most of the event loop's time per request under a load of single-text requests)."""

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY)


def openai_body(job: EmbeddingJob, model: str, vectors: np.ndarray, usage: Usage) -> dict[str, Any]:
    rows = np.ascontiguousarray(vectors, dtype="<f4")
    data: Sequence[Any]
    if job.encoding_format == "base64":
        data = [base64.b64encode(row.tobytes()).decode("ascii") for row in rows]
    else:
        data = rows  # one array per row, for VectorsResponse
    return {
        "object": "list",
        "data": [{"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(data)],
        "model": model,
        "usage": {"prompt_tokens": usage.prompt_tokens, "total_tokens": usage.prompt_tokens},
    }


def workers_ai_body(vectors: np.ndarray) -> dict[str, Any]:
    rows = np.ascontiguousarray(vectors, dtype=np.float32)
    return {
        "result": {"shape": list(rows.shape), "data": rows},
        "success": True,
        "errors": [],
        "messages": [],
    }


def wrong_task(model: str, task: str) -> ApiError:
    if task == "embed":
        return bad_request(f"model {model} is an embedding model; use /v1/embeddings", "model")
    return bad_request(f"model {model} is not an embedding model; /v1/embeddings needs one", "model")

"""Embedding vectors in either API's response body."""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import Any

import numpy as np
import orjson
from fastapi.responses import JSONResponse

from edgeinfer.api.embeddings import EmbeddingJob
from edgeinfer.types import Usage


class VectorsResponse(JSONResponse):
    """JSON whose numpy arrays orjson writes itself: each float32 in its shortest form that reads back to
    the same float32 (9 digits at most, not float64's 17), without the `tolist()` and `json` round trip
    that took most of the event loop's time per request under a load of single-text requests."""

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

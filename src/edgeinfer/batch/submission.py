"""The Batch API's bodies: a submission `{"requests": [...]}`, each entry a body the model's own route takes,
or a poll `{"request_id": "..."}`. A submission is checked whole before anything is queued, so a malformed
batch is one 400 that names its first bad entry, and nothing of it runs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from edgeinfer.api.embeddings import workers_ai_embedding_job
from edgeinfer.api.errors import ApiError, bad_request
from edgeinfer.api.limits import NodeLimits
from edgeinfer.api.prepare import check_one_workers_ai_input, workers_ai_job
from edgeinfer.api.schemas import WorkersAIRunRequest

# Workers AI takes payloads under 10 MB; entries are bounded too, so that a poll's answer stays readable.
MAX_ENTRIES = 10_000
MAX_REFERENCE_CHARS = 256


@dataclass(frozen=True)
class Entry:
    """One queued request: its place in the batch, its body (as the model's route takes it) and the
    client's `external_reference`, returned with its result."""

    index: int
    body: dict[str, Any]
    external_reference: str | None = None


@dataclass(frozen=True)
class Poll:
    request_id: str


def read_batch_body(value: Any, model: str, limits: NodeLimits, *, embeddings: bool) -> list[Entry] | Poll:
    """The entries of a submission, or the id a poll asks for; 400 (naming the entry) for anything else."""
    if not isinstance(value, dict):
        raise bad_request('a queued request\'s body is an object: {"requests": [...]} or {"request_id": ...}')
    if "request_id" in value:
        request_id = value["request_id"]
        if not isinstance(request_id, str) or not request_id:
            raise bad_request("request_id: must be the id a queued request was answered with", "request_id")
        return Poll(request_id)
    requests = value.get("requests")
    if not isinstance(requests, list) or not requests:
        raise bad_request("requests: a non-empty list of request bodies is required", "requests")
    if len(requests) > MAX_ENTRIES:
        raise bad_request(f"requests: at most {MAX_ENTRIES} entries in one batch", "requests")
    return [_entry(i, raw, model, limits, embeddings) for i, raw in enumerate(requests)]


def _entry(index: int, raw: Any, model: str, limits: NodeLimits, embeddings: bool) -> Entry:
    where = f"requests[{index}]"
    if not isinstance(raw, dict):
        raise bad_request(f"{where}: must be an object (a request body)", where)
    reference = raw.get("external_reference")
    if reference is not None and (not isinstance(reference, str) or len(reference) > MAX_REFERENCE_CHARS):
        raise bad_request(f"{where}.external_reference: a string of at most {MAX_REFERENCE_CHARS} characters")
    if raw.get("stream"):
        raise bad_request(f"{where}.stream: a queued request cannot stream; poll for its result", where)
    try:
        body = WorkersAIRunRequest.model_validate(raw)
        check_one_workers_ai_input(body)
        if embeddings:
            workers_ai_embedding_job(model, body, limits)
        else:
            workers_ai_job(model, body, raw, limits)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(part) for part in first["loc"])
        param = f"{where}.{field}" if field else where
        raise bad_request(f"{param}: {first['msg']}", param) from None
    except ApiError as exc:
        param = f"{where}.{exc.param}" if exc.param else where
        raise bad_request(f"{where}: {exc.message}", param) from None
    return Entry(index, raw, reference)

"""Running one admitted embeddings request on its leased member: queue check, tokens, forward, bookkeeping."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from starlette.requests import Request

from edgeinfer.api.embeddings import EmbeddingJob
from edgeinfer.api.errors import STATUS_CLIENT_CLOSED, ApiError, bad_request, busy, internal
from edgeinfer.api.http.disconnect import ClientDisconnected, until_disconnect
from edgeinfer.api.limits import NodeLimits
from edgeinfer.obs.timing import LatencyBreakdown
from edgeinfer.pool.member import EMBED, EmbeddingMember
from edgeinfer.types import Usage
from edgeinfer.types.validation import InvalidInput, check_embedding_inputs

if TYPE_CHECKING:
    from edgeinfer.node.run import RequestRun

# Texts up to this many characters together are tokenized on the event loop: a short text tokenizes faster
# than it can be handed to a worker thread and back (two GIL handovers each way, under load the larger cost
# of a small request).
INLINE_TOKENIZE_CHARS = 4096


@dataclass(frozen=True)
class EmbeddingOutcome:
    """What a route renders; `vectors` already cut to the requested dimensions."""

    vectors: np.ndarray
    usage: Usage
    request_id: str
    timing: str


async def embedding_inputs(run: RequestRun, limits: NodeLimits) -> list[list[int]]:
    """The job's token ids, after the member's queue and the request's limits are checked (ApiError)."""
    member = run.lease.member
    if not isinstance(member, EmbeddingMember):
        raise internal(f"model {run.model} is not loaded as an embedding model")
    engine, job = member.engine, run.job
    stats = engine.stats()
    if stats.num_waiting >= limits.max_queue_depth:
        raise busy(f"model {run.model} queue is full ({limits.max_queue_depth} requests waiting)")
    if job.reject_if_busy and (stats.num_waiting or stats.num_running):
        raise busy(f"model {run.model} is busy and the request asked not to wait (rejectIfBusy)")
    embedder = engine.embedder
    if job.dimensions is not None and job.dimensions > embedder.dim:
        raise bad_request(f"dimensions {job.dimensions} is above this model's {embedder.dim}", "dimensions")
    args = (job, embedder.tokenize, embedder.max_seq_length, embedder.vocab_size, limits)
    if _text_chars(job) <= INLINE_TOKENIZE_CHARS:
        return token_ids(*args)
    # Tokenizing many or long texts takes a while: off the event loop.
    return await asyncio.to_thread(token_ids, *args)


def _text_chars(job: EmbeddingJob) -> int:
    return sum(len(x) for x in job.inputs if isinstance(x, str))


async def run_embeddings(
    request: Request | None, run: RequestRun, ids: list[list[int]]
) -> EmbeddingOutcome | None:
    """Embed; None when the client went away first (`request` None: no client waits, a queued entry).
    `run.finish` is always called."""
    member = run.lease.member
    assert isinstance(member, EmbeddingMember)
    engine = member.engine
    run.started = True
    status, tokens = 500, sum(len(seq) for seq in ids)
    try:
        work = engine.embed(run.job.request_id, ids)
        result = await (work if request is None else until_disconnect(request, work))
        status = 200
    except ClientDisconnected:
        status = STATUS_CLIENT_CLOSED
        return None
    except ApiError as exc:
        status = exc.status
        raise
    except ValueError as exc:  # EngineInputError: the inputs cannot be embedded
        status = 400
        raise bad_request(str(exc), "input") from None
    finally:
        # Billed only when answered: a request cut short has no vectors to show for its tokens.
        run.outcome.usage = Usage(prompt_tokens=tokens if status == 200 else 0)
        run.outcome.version = member.version
        if status == 200:
            run.outcome.latency = LatencyBreakdown(queue=result.queue_s, e2e=result.e2e_s)
        run.finish(status)
    run.metrics.observe_embedding(run.model, len(ids), result.batch_sizes)
    vectors = shorten(result.vectors, run.job.dimensions, engine.embedder.sentence.normalize)
    return EmbeddingOutcome(
        vectors, run.outcome.usage, run.job.request_id, run.outcome.latency.header_value()
    )


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


def wrong_task(model: str, task: str) -> ApiError:
    if task == EMBED:
        return bad_request(f"model {model} is an embedding model; use /v1/embeddings", "model")
    return bad_request(f"model {model} is not an embedding model; /v1/embeddings needs one", "model")

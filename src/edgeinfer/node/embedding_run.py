"""Running one admitted embeddings request on its leased member: queue check, tokens, forward, bookkeeping."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from starlette.requests import Request

from edgeinfer.node.config import NodeLimits
from edgeinfer.node.disconnect import ClientDisconnected, until_disconnect
from edgeinfer.node.embeddings import EmbeddingJob, shorten, token_ids
from edgeinfer.node.errors import ApiError, bad_request, busy, internal
from edgeinfer.obs.timing import LatencyBreakdown
from edgeinfer.pool.member import EmbeddingMember
from edgeinfer.types import Usage

if TYPE_CHECKING:
    from edgeinfer.node.run import RequestRun

STATUS_CLIENT_CLOSED = 499
# Texts up to this many characters together are tokenized on the event loop: that takes tens of µs,
# less than handing them to a worker thread and back (two GIL handovers each way, under load the
# larger cost of a small request).
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
    # Tokenizing 2048 texts takes a while: off the event loop.
    return await asyncio.to_thread(token_ids, *args)


def _text_chars(job: EmbeddingJob) -> int:
    return sum(len(x) for x in job.inputs if isinstance(x, str))


async def run_embeddings(request: Request, run: RequestRun, ids: list[list[int]]) -> EmbeddingOutcome | None:
    """Embed; None when the client went away first. `run.finish` is always called."""
    member = run.lease.member
    assert isinstance(member, EmbeddingMember)
    engine = member.engine
    run.started = True
    status, tokens = 500, sum(len(seq) for seq in ids)
    try:
        result = await until_disconnect(request, engine.embed(run.job.request_id, ids))
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

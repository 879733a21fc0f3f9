"""AsyncEmbeddingEngine: the embedder's forward passes in a background thread, awaitable per request.

Requests hand their token ids to the engine thread, whose batcher packs the inputs of every waiting
request into shared forward passes; each request's future resolves once all its inputs are embedded.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from edgeinfer.engine.embedding.config import EmbeddingConfig
from edgeinfer.engine.embedding.embedder import Embedder
from edgeinfer.engine.errors import EngineInputError
from edgeinfer.engine.scheduler.embed_batcher import EmbedBatcher, EmbedItem
from edgeinfer.types.validation import InvalidInput, check_embedding_inputs

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EmbeddingResult:
    """`vectors` [n, dim] float32 in input order (numpy, so the node needs no torch); `batch_sizes`:
    inputs in each forward pass this request shared; `queue_s`: arrival to its first forward pass;
    `e2e_s`: arrival to its last."""

    vectors: np.ndarray
    num_tokens: int
    batch_sizes: list[int]
    queue_s: float
    e2e_s: float


@dataclass(frozen=True)
class EmbeddingStats:
    num_waiting: int  # requests with inputs not yet embedded
    num_running: int  # 1 while a forward pass runs
    forward_passes: int
    inputs_embedded: int


@dataclass
class _Pending:
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[EmbeddingResult]
    inputs: Sequence[Sequence[int]]
    arrival: float
    vectors: np.ndarray
    remaining: int
    batch_sizes: list[int] = field(default_factory=list)
    first_forward: float | None = None
    last_forward: float | None = None


class AsyncEmbeddingEngine:
    def __init__(self, embedder: Embedder, clock: Callable[[], float] = time.monotonic) -> None:
        self.embedder = embedder
        self.clock = clock
        cfg = embedder.config
        self._batcher = EmbedBatcher(cfg.max_batch_tokens, cfg.max_batch_size, cfg.batch_window_ms / 1000.0)
        self._inbox: queue.SimpleQueue[tuple[str, str, _Pending | None]] = queue.SimpleQueue()
        self._pending: dict[str, _Pending] = {}
        self._wake = threading.Event()
        self._stopped = False
        self._running = 0
        self._forward_passes = 0
        self._inputs_embedded = 0
        self._thread = threading.Thread(target=self._run, name="edgeinfer-embed", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EmbeddingConfig) -> AsyncEmbeddingEngine:
        return cls(Embedder(config))

    def validate(self, inputs: Sequence[Sequence[int]]) -> None:
        """EngineInputError for inputs the model can never embed."""
        try:
            check_embedding_inputs(inputs, self.embedder.vocab_size, self.embedder.max_seq_length)
        except InvalidInput as e:
            raise EngineInputError(str(e)) from None

    async def embed(self, request_id: str, inputs: Sequence[Sequence[int]]) -> EmbeddingResult:
        """Embed every input; cancelling the caller drops the inputs not yet embedded."""
        self.validate(inputs)
        loop = asyncio.get_running_loop()
        empty = np.empty((len(inputs), self.embedder.dim), dtype=np.float32)
        pending = _Pending(loop, loop.create_future(), inputs, self.clock(), empty, len(inputs))
        self._send("add", request_id, pending)
        answered = False
        try:
            result = await pending.future
            answered = True
            return result
        finally:
            if not answered:  # cancelled (the future with it) or failed: nothing more to compute
                self._send("drop", request_id, None)

    def stats(self) -> EmbeddingStats:
        # Plain reads, no lock: a metrics scrape never waits for a forward pass; may be one pass stale.
        return EmbeddingStats(len(self._pending), self._running, self._forward_passes, self._inputs_embedded)

    def memory_bytes(self) -> int:
        return self.embedder.memory_bytes()

    async def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        await asyncio.to_thread(self._thread.join)

    def _send(self, kind: str, request_id: str, pending: _Pending | None) -> None:
        self._inbox.put((kind, request_id, pending))
        self._wake.set()

    # ---- the loop (engine thread) ----------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopped:
            self._drain_inbox()
            ready = self._batcher.ready_at()
            now = self.clock()
            if ready is not None and ready <= now:
                self._forward()
                continue
            self._wake.wait(None if ready is None else ready - now)
            self._wake.clear()

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, request_id, pending = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "drop":
                self._pending.pop(request_id, None)
                self._batcher.drop(request_id)
            elif pending is not None:
                self._pending[request_id] = pending
                self._batcher.add(
                    [
                        EmbedItem(request_id, i, len(ids), pending.arrival)
                        for i, ids in enumerate(pending.inputs)
                    ]
                )

    def _forward(self) -> None:
        items = [item for item in self._batcher.take() if item.request_id in self._pending]
        if not items:
            return
        started = self.clock()
        self._running = 1
        try:
            vectors = self.embedder.embed(
                [self._pending[it.request_id].inputs[it.index] for it in items]
            ).numpy()
        except Exception as exc:  # a failed pass fails its requests, never the loop
            log.exception("embedding forward pass failed")
            for request_id in {it.request_id for it in items}:
                self._fail(request_id, exc)
            return
        finally:
            self._running = 0
        self._forward_passes += 1
        self._inputs_embedded += len(items)
        for row, item in enumerate(items):
            self._store(item, vectors[row], len(items), started)

    def _store(self, item: EmbedItem, vector: np.ndarray, batch_size: int, started: float) -> None:
        pending = self._pending.get(item.request_id)
        if pending is None:
            return
        pending.vectors[item.index] = vector
        if pending.last_forward != started:  # the first of its inputs in this pass
            pending.batch_sizes.append(batch_size)
            pending.last_forward = started
        if pending.first_forward is None:
            pending.first_forward = started
        pending.remaining -= 1
        if pending.remaining == 0:
            del self._pending[item.request_id]
            now = self.clock()
            result = EmbeddingResult(
                pending.vectors,
                sum(len(ids) for ids in pending.inputs),
                pending.batch_sizes,
                pending.first_forward - pending.arrival,
                now - pending.arrival,
            )
            pending.loop.call_soon_threadsafe(_resolve, pending.future, result)

    def _fail(self, request_id: str, exc: BaseException) -> None:
        pending = self._pending.pop(request_id, None)
        self._batcher.drop(request_id)
        if pending is not None:
            pending.loop.call_soon_threadsafe(_reject, pending.future, exc)


def _resolve(future: asyncio.Future[EmbeddingResult], result: EmbeddingResult) -> None:
    if not future.done():
        future.set_result(result)


def _reject(future: asyncio.Future[EmbeddingResult], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)

"""AsyncLLMEngine: the engine's step loop in a background thread, streams for asyncio callers.

The loop never waits on a client: outputs go into per-request asyncio queues with `put_nowait`, so a
slow reader only lets its own queue grow (bounded by its max_tokens) while everyone else proceeds.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from edgeinfer.engine.config import EngineConfig
from edgeinfer.engine.engine import EngineStats, LLMEngine
from edgeinfer.engine.threads import name_os_thread
from edgeinfer.types import EngineRequest, RequestOutput, Usage
from edgeinfer.types.request import Lane

log = logging.getLogger(__name__)

# The step thread's OS name (and so its OpenMP workers'), as /proc, top -H and bench/serve_overhead.py see it.
STEP_THREAD_NAME = "edgeinfer-step"
# The answer to an abort of a request the engine no longer holds (it finished meanwhile).
_ABORT_SEEN = object()
# How long a caller that left waits for the engine to answer its abort (one step, normally).
_ABORT_WAIT_S = 10.0
_ABORT_POLL_S = 0.25  # how often that wait checks the loop is still alive


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_name = engine.config.model
        self.max_model_len = engine.layout.max_model_len
        self._inbox: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()  # held while the loop touches the engine
        self._wake = threading.Event()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="edgeinfer-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncLLMEngine:
        return cls(LLMEngine(config))

    async def generate(
        self, request: EngineRequest, on_final_usage: Callable[[Usage], None] | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Stream deltas until the request finishes; leaving early aborts it and frees its blocks.

        `on_final_usage` receives what the engine computed for the request when the caller leaves early:
        outputs it never took (a client that stopped reading) and tokens made before the abort landed count
        too, so a bill never stops at what the writer pulled."""
        self.engine.validate(request)
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._streams[request.request_id] = stream
        self._inbox.put(("add", request))
        if request.lane is Lane.INTERACTIVE:
            self.engine.runner.interrupt.request()  # a batch-only step in flight gives way at its next layer
        self._wake.set()
        finished = False
        try:
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            try:
                if not finished:
                    usage = await self._final_usage(request.request_id, stream)
                    if usage is not None and on_final_usage is not None:
                        on_final_usage(usage)
            finally:
                self._streams.pop(request.request_id, None)

    async def _final_usage(self, request_id: str, stream: _Stream) -> Usage | None:
        """What the engine computed for a request its caller left: the usage of the last output queued for
        it. Where that is not its final one, the request is aborted and the engine's answer awaited (it
        answers every abort, after the outputs it queued before; `_ABORT_SEEN` when the request had already
        left it); a stopped loop answers nothing."""
        usage, final = None, False
        while not final and not stream.queue.empty():
            usage, final = _taken(stream.queue.get_nowait(), usage)
        if final:
            return usage
        self.abort(request_id)
        deadline = time.monotonic() + _ABORT_WAIT_S
        while not final and time.monotonic() < deadline:
            if stream.queue.empty() and self.health() is not None:
                break
            try:
                item = await asyncio.wait_for(stream.queue.get(), _ABORT_POLL_S)
            except TimeoutError:
                continue
            usage, final = _taken(item, usage)
        return usage

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))
        self._wake.set()

    def has_adapter(self, name: str) -> bool:
        return self.engine.adapters.has(name)

    def resident_adapters(self) -> list[str]:
        """The registered adapters whose weights are in memory now (read without waiting for a step)."""
        return self.engine.adapters.resident()

    async def load_adapter(self, name: str, path: str) -> None:
        """Register a LoRA adapter (engine/lora/) off the event loop: it reads and hashes its files. The
        registry takes its own lock, and the model's hooks go on in the engine thread (AdapterError: a
        ValueError saying why it cannot be served)."""
        await asyncio.to_thread(self.engine.load_adapter, name, path)

    def stats(self) -> EngineStats:
        # No lock: plain counter reads are atomic under the GIL, and a metrics scrape must never wait
        # for a model step. The numbers may be one step stale.
        return self.engine.stats()

    def memory_bytes(self) -> int:
        return self.engine.memory_bytes()

    def check_integrity(self) -> None:
        with self._lock:
            self.engine.check_integrity()

    def health(self) -> str | None:
        """None while the engine thread runs, else why requests would wait forever."""
        return None if self._thread.is_alive() else "the engine loop has stopped"

    async def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        await asyncio.to_thread(self._thread.join)

    # ---- the loop (engine thread) ----------------------------------------------------------------
    def _run(self) -> None:
        name_os_thread(STEP_THREAD_NAME)
        while not self._stopped:
            with self._lock:
                # first: a request that arrives after the drain stops the next step if it is batch-only
                self.engine.runner.interrupt.clear()
                self._drain_inbox()
                wake = self.engine.next_wakeup()
                now = self.engine.clock()
                if wake is not None and wake <= now:
                    self._step()
                    continue
            timeout = None if wake is None else max(0.0, wake - now)
            self._wake.wait(timeout)
            self._wake.clear()

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self._add(payload)
            else:
                out = self.engine.abort(payload)
                self._deliver(out if out is not None else _ABORT_SEEN, payload)

    def _add(self, request: EngineRequest) -> None:
        if request.request_id not in self._streams:
            return  # the caller left before the loop saw the request
        try:
            self.engine.add_request(request)
        except Exception as e:
            self._deliver_error(request.request_id, e)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:  # a bug in a step must not kill the loop silently for everyone
            log.exception("engine step failed; failing the running requests")
            for rid in list(self.engine.scheduler.requests):
                self.engine.abort(rid)
                self._deliver_error(rid, e)
            return
        # one wake-up per event loop per step, not one per stream
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                batches.setdefault(stream.loop, []).append((stream.queue, out))
        for loop, items in batches.items():
            loop.call_soon_threadsafe(_put_all, items)

    def _deliver(self, out: object, request_id: str) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, out)

    def _deliver_error(self, request_id: str, error: BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, error)


def _taken(item: object, usage: Usage | None) -> tuple[Usage | None, bool]:
    """(the latest usage, whether the stream has ended) after one more queued item."""
    if isinstance(item, RequestOutput):
        return item.usage, item.finished
    return usage, True  # `_ABORT_SEEN` or an error: nothing more will come


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for q, out in items:
        q.put_nowait(out)

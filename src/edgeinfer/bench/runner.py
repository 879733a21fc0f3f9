"""The load generator: sessions arrive on a Poisson (or gamma-bursty) clock, requests share a concurrency cap.

Each session runs as its own task from its arrival time; a multi-turn session sends turn k+1 only after turn
k's answer has streamed back, with that answer in the history (so servers with a prefix cache can reuse it),
and tags every turn with an `x-session-affinity` header so a router can keep the session on one node.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import httpx

from edgeinfer.bench.client import ENDPOINTS, RequestRecord, RequestSpec, build_payload, send_request
from edgeinfer.bench.datasets import Session, random_words
from edgeinfer.bench.metrics import SLO, Summary, summarize

AFFINITY_HEADER = "x-session-affinity"


@dataclass(frozen=True)
class BenchConfig:
    """How to drive the server. `request_rate` is sessions per second (math.inf: all at once)."""

    base_url: str
    model: str
    endpoint: str = "/v1/completions"
    request_rate: float = math.inf
    # Gamma shape of the inter-arrival times: 1 is Poisson, < 1 burstier, > 1 more regular.
    burstiness: float = 1.0
    max_concurrency: int | None = None
    num_warmups: int = 0
    seed: int = 0
    api_key: str | None = None
    slo: SLO = field(default_factory=SLO)
    request_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"unknown endpoint {self.endpoint!r}; expected one of {', '.join(ENDPOINTS)}")
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0 (or inf), got {self.request_rate}")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness must be > 0, got {self.burstiness}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if self.num_warmups < 0:
            raise ValueError(f"num_warmups must be >= 0, got {self.num_warmups}")


@dataclass
class BenchResult:
    """A finished run: its summary and every request's record (in completion order)."""

    summary: Summary
    records: list[RequestRecord]


def arrival_offsets(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Start times (seconds from the run's start) of `n` sessions: the first at 0, then gamma-distributed gaps
    with mean 1/rate and shape `burstiness` (exponential gaps, i.e. a Poisson process, when it is 1).
    """
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    scale = 1.0 / (rate * burstiness)
    offsets, t = [], 0.0
    for i in range(n):
        if i:
            t += rng.gammavariate(burstiness, scale)
        offsets.append(t)
    return offsets


class _Run:
    """State shared by the session tasks of one run."""

    def __init__(self, config: BenchConfig, client: httpx.AsyncClient, progress: Callable[[], None] | None):
        self.config = config
        self.client = client
        self.url = config.base_url.rstrip("/") + config.endpoint
        self.limit = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
        self.records: list[RequestRecord] = []
        self.progress = progress

    def headers(self, session: Session) -> dict[str, str]:
        headers = {}
        if self.config.api_key:
            headers["authorization"] = f"Bearer {self.config.api_key}"
        if session.multi_turn:
            headers[AFFINITY_HEADER] = session.session_id
        return headers

    async def send(self, spec: RequestSpec, headers: dict[str, str]) -> RequestRecord:
        payload = build_payload(self.config.endpoint, self.config.model, spec)
        async with self.limit or contextlib.nullcontext():
            return await send_request(self.client, self.url, payload, spec, headers)

    async def run_session(self, session: Session, start_at: float) -> None:
        await asyncio.sleep(max(0.0, start_at - time.perf_counter()))
        history = _History(chat=self.config.endpoint == "/v1/chat/completions")
        headers = self.headers(session)
        for i, turn in enumerate(session.turns):
            spec = history.next_request(turn.text, turn.max_tokens, turn.approx_tokens)
            record = await self.send(spec, headers)
            self._add(record)
            if not record.ok:
                for skipped in session.turns[i + 1 :]:  # later turns need this answer: count them as failed
                    error = "skipped: an earlier turn of its session failed"
                    self._add(RequestRecord(error=error, requested_tokens=skipped.max_tokens))
                return
            history.add_answer(record.text, record.output_tokens)

    def _add(self, record: RequestRecord) -> None:
        self.records.append(record)
        if self.progress:
            self.progress()


class _History:
    """A session's context so far, rendered as chat messages or as one growing text prompt."""

    def __init__(self, chat: bool):
        self.chat = chat
        self.messages: list[dict[str, str]] = []
        self.approx_tokens = 0

    def next_request(self, text: str, max_tokens: int, approx: int) -> RequestSpec:
        self.messages.append({"role": "user", "content": text})
        self.approx_tokens += approx
        prompt: str | list[dict[str, str]] = (
            list(self.messages) if self.chat else "\n".join(m["content"] for m in self.messages)
        )
        return RequestSpec(prompt, max_tokens, self.approx_tokens)

    def add_answer(self, text: str, tokens: int) -> None:
        self.messages.append({"role": "assistant", "content": text})
        self.approx_tokens += tokens


async def run_benchmark(
    config: BenchConfig, sessions: Sequence[Session], progress: Callable[[], None] | None = None
) -> BenchResult:
    """Drive the server with `sessions` as `config` says; request failures are recorded, not raised."""
    if not sessions:
        raise ValueError("run_benchmark needs at least one session")
    timeout = httpx.Timeout(config.request_timeout_s, connect=30.0)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        run = _Run(config, client, progress)
        await _warm_up(run, sessions[0])
        offsets = arrival_offsets(len(sessions), config.request_rate, config.burstiness, config.seed)
        t0 = time.perf_counter()
        tasks = [run.run_session(s, t0 + off) for s, off in zip(sessions, offsets, strict=True)]
        await asyncio.gather(*tasks)
        t_end = max((r.start + r.e2e for r in run.records if r.ok), default=time.perf_counter())
    return BenchResult(summary=summarize(run.records, max(t_end - t0, 1e-9), config.slo), records=run.records)


async def _warm_up(run: _Run, session: Session) -> None:
    """Send `num_warmups` unrecorded requests shaped like the first turn, so one-time costs (allocation,
    compilation) are paid: the first alone, the rest at once, as a server may compile a one-sequence and a
    batched step separately. Their words are fresh, so no measured prompt is already in a prefix cache.
    """
    rng = random.Random(run.config.seed ^ 0x5EED)
    turn = session.turns[0]

    async def one() -> None:
        text = random_words(rng, turn.approx_tokens)
        spec = RequestSpec(text, min(turn.max_tokens, 16), turn.approx_tokens)
        payload = build_payload(run.config.endpoint, run.config.model, spec)
        await send_request(run.client, run.url, payload, spec, run.headers(session))

    if run.config.num_warmups:
        await one()
        await asyncio.gather(*(one() for _ in range(run.config.num_warmups - 1)))

"""One streaming request to an OpenAI-compatible server, timed chunk by chunk.

Output lengths are forced with `max_tokens` plus `ignore_eos` (honoured by vLLM, SGLang, llama.cpp's server
and ours), and the exact token counts come from the usage chunk that `stream_options.include_usage` asks for.
A server that sends no usage gets its output counted as one token per content chunk (true for servers that
stream token by token) and its input estimated from the prompt's word count; the record says which applied.
"""

from __future__ import annotations

import itertools
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from edgeinfer.bench.sse import DONE_SENTINEL, SSEParser

ENDPOINTS: tuple[str, ...] = ("/v1/completions", "/v1/chat/completions")


@dataclass
class RequestSpec:
    """What to send: a prompt (completions) or messages (chat), the answer length, an input-size estimate."""

    prompt: str | list[dict[str, str]]
    max_tokens: int
    approx_prompt_tokens: int


@dataclass
class RequestRecord:
    """What happened to one request. Times are seconds on the perf_counter clock."""

    ok: bool = False
    error: str = ""
    start: float = 0.0
    ttft: float = 0.0  # start to first content chunk
    e2e: float = 0.0  # start to end of stream
    chunk_times: list[float] = field(default_factory=list)  # arrival time of each content chunk
    prompt_tokens: int = 0
    output_tokens: int = 0
    usage_reported: bool = False
    # The max_tokens asked for: fewer output_tokens means the server stopped early (ignore_eos not honoured).
    requested_tokens: int = 0
    finish_reason: str | None = None
    text: str = ""

    @property
    def itls(self) -> list[float]:
        """Gaps between consecutive content chunks (inter-token latencies for per-token streaming)."""
        return [b - a for a, b in itertools.pairwise(self.chunk_times)]

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first; None for answers of fewer than two tokens."""
        if self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def build_payload(endpoint: str, model: str, spec: RequestSpec) -> dict[str, Any]:
    """The JSON body for `endpoint`: streaming with usage, a fixed output length, greedy sampling."""
    payload: dict[str, Any] = {
        "model": model,
        "max_tokens": spec.max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if endpoint == "/v1/chat/completions":
        is_text = isinstance(spec.prompt, str)
        payload["messages"] = [{"role": "user", "content": spec.prompt}] if is_text else spec.prompt
    elif endpoint == "/v1/completions":
        if not isinstance(spec.prompt, str):
            raise ValueError("the /v1/completions endpoint takes a text prompt, not chat messages")
        payload["prompt"] = spec.prompt
    else:
        raise ValueError(f"unknown endpoint {endpoint!r}; expected one of {', '.join(ENDPOINTS)}")
    return payload


def _chunk_text(chunk: dict[str, Any]) -> str:
    """The generated text in one chunk (completions: choices[0].text; chat: choices[0].delta.content)."""
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if "text" in choice:
        return choice.get("text") or ""
    return (choice.get("delta") or {}).get("content") or ""


def _apply_chunk(record: RequestRecord, chunk: dict[str, Any], now: float) -> None:
    if "error" in chunk:
        raise _StreamError(json.dumps(chunk["error"])[:300])
    text = _chunk_text(chunk)
    if text:
        if not record.chunk_times:
            record.ttft = now - record.start
        record.chunk_times.append(now)
        record.text += text
    choices = chunk.get("choices") or []
    if choices and choices[0].get("finish_reason"):
        record.finish_reason = choices[0]["finish_reason"]
    usage = chunk.get("usage")
    if usage:
        record.usage_reported = True
        record.prompt_tokens = int(usage.get("prompt_tokens", 0))
        record.output_tokens = int(usage.get("completion_tokens", 0))


class _StreamError(Exception):
    """The server reported an error inside the stream."""


async def send_request(
    client: httpx.AsyncClient, url: str, payload: dict[str, Any], spec: RequestSpec, headers: dict[str, str]
) -> RequestRecord:
    """POST `payload` to `url`, consume the SSE stream and return its record. Never raises for server or
    network failures: they become `ok=False` with `error` set, so one bad request cannot end a benchmark run.
    """
    record = RequestRecord(start=time.perf_counter(), requested_tokens=spec.max_tokens)
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                record.error = f"HTTP {response.status_code}: {body[:300]}"
                return record
            await _consume(response, record)
    except (httpx.HTTPError, _StreamError, json.JSONDecodeError, ValueError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"[:400]
        return record
    record.e2e = time.perf_counter() - record.start
    if not record.usage_reported:
        record.output_tokens = len(record.chunk_times)
        record.prompt_tokens = spec.approx_prompt_tokens
    if not record.chunk_times:
        record.error = "stream ended without any generated text"
        return record
    record.ok = True
    return record


async def _consume(response: httpx.Response, record: RequestRecord) -> None:
    parser = SSEParser()
    async for text in response.aiter_text():
        now = time.perf_counter()
        for event in parser.feed(text):
            if event.data.strip() == DONE_SENTINEL:
                return
            _apply_chunk(record, json.loads(event.data), now)
    for event in parser.close():
        if event.data.strip() != DONE_SENTINEL:
            _apply_chunk(record, json.loads(event.data), time.perf_counter())

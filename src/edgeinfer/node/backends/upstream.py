"""Runs jobs on an upstream OpenAI-compatible server: token counts come from the upstream's usage."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from edgeinfer.api.errors import upstream_failed
from edgeinfer.api.jobs import CHAT, Job, JobKind
from edgeinfer.api.limits import NodeLimits
from edgeinfer.api.tenants import Tenant
from edgeinfer.node.backends.base import Backend, ChoiceDelta, LogprobEntry, Outcome
from edgeinfer.obs.timing import LatencyBreakdown
from edgeinfer.pool.upstream import UpstreamError, UpstreamMember
from edgeinfer.types import Usage
from edgeinfer.types.cache_salt import UPSTREAM_FIELD

# Without the served model's tokenizer (`--upstream-tokenizer`), the tokens/min reservation estimates
# ~4 characters per token; either way it is settled to the upstream's real usage when the request ends.
CHARS_PER_TOKEN = 4
# Never forwarded as the client sent them: our own options, and `cache_salt`, which the node sets to the
# tenant's salt so that SGLang / vLLM keep each tenant's prefix cache apart (a client-set salt would let
# it probe another tenant's cache).
_OUR_FIELDS = ("options", UPSTREAM_FIELD)


class UpstreamBackend(Backend):
    def __init__(self, member: UpstreamMember, limits: NodeLimits, tenant: Tenant) -> None:
        self._member = member
        self._limits = limits
        self._cache_salt = tenant.cache_namespace
        self._prompt_estimate = 0
        self.version = member.version

    def prepare(self, job: Job) -> int:
        tok = self._member.tokenizer
        self._prompt_estimate = _estimate(job) if tok is None else _count(tok, job)
        return self._prompt_estimate + job.num_choices * (job.max_tokens or self._limits.max_tokens)

    async def run(self, job: Job, outcome: Outcome) -> AsyncGenerator[ChoiceDelta, None]:
        outcome.version = self.version
        body = {k: v for k, v in job.upstream_body.items() if k not in _OUR_FIELDS}
        body[UPSTREAM_FIELD] = self._cache_salt
        try:
            if job.stream:
                body.update(stream=True, stream_options={"include_usage": True})
                # aclosing: a client that leaves closes the upstream response at once (so the upstream
                # aborts too), not whenever the garbage collector finalizes the generators.
                async with contextlib.aclosing(self._stream(job, body, outcome)) as deltas:
                    async for delta in deltas:
                        yield delta
            else:
                body.update(stream=False)
                body.pop("stream_options", None)
                for delta in await self._complete(job, body, outcome):
                    yield delta
        except UpstreamError as exc:
            raise upstream_failed(exc.status, exc.message) from exc

    async def _complete(self, job: Job, body: dict[str, Any], outcome: Outcome) -> list[ChoiceDelta]:
        data = await self._member.post_json(job.upstream_path, body)
        elapsed = time.monotonic() - job.arrival
        outcome.latency = LatencyBreakdown(ttft=elapsed, e2e=elapsed)
        outcome.usage = _usage(data.get("usage"))
        deltas = []
        for choice in data.get("choices") or []:
            message = choice.get("message") or {}
            text = choice.get("text") if job.kind != CHAT else message.get("content")
            calls = message.get("tool_calls") if isinstance(message.get("tool_calls"), list) else None
            deltas.append(
                ChoiceDelta(
                    index=int(choice.get("index", 0)),
                    text=text or "",
                    logprobs=_logprobs(choice.get("logprobs"), job.kind),
                    finish_reason=choice.get("finish_reason") or "stop",
                    reasoning=message.get("reasoning_content") or "",
                    tool_calls=[{"index": i, **c} for i, c in enumerate(calls)] if calls else None,
                )
            )
        return deltas

    async def _stream(self, job: Job, body: dict[str, Any], outcome: Outcome) -> AsyncIterator[ChoiceDelta]:
        last: float | None = None
        ttft = None
        chunks = 0
        try:
            async with contextlib.aclosing(self._member.stream(job.upstream_path, body)) as events:
                async for event in events:
                    if event.get("usage"):
                        outcome.usage = _usage(event["usage"])
                    for choice in event.get("choices") or []:
                        delta = _stream_delta(choice, job.kind)
                        if delta is None:
                            continue
                        now = time.monotonic()
                        if delta.text:
                            # One streamed chunk is one token for OpenAI-compatible servers.
                            chunks += 1
                            if last is None:
                                ttft = now - job.arrival
                            else:
                                outcome.inter_token_latencies.append(now - last)
                            last = now
                        yield delta
        finally:
            outcome.latency = LatencyBreakdown(ttft=ttft, e2e=time.monotonic() - job.arrival)
            if outcome.usage.total_tokens == 0 and chunks:
                # Cut short before the upstream's usage event: bill our estimate of what it did.
                outcome.usage = Usage(prompt_tokens=self._prompt_estimate, completion_tokens=chunks)


def _count(tok: Any, job: Job) -> int:
    """Prompt tokens by the served model's tokenizer (a template the tokenizer refuses: the estimate; the
    upstream judges the messages itself)."""
    if job.kind == CHAT:
        try:
            text = tok.apply_chat_template(job.messages, True, tools=job.tools or None)
        except ValueError:
            return _estimate(job)
        return len(tok.encode(text, add_special_tokens=False))
    return sum(len(tok.encode(p)) if isinstance(p, str) else len(p) for p in job.prompts)


def _estimate(job: Job) -> int:
    if job.kind == CHAT:
        chars = sum(len(m.get("content") or "") for m in job.messages)
        return chars // CHARS_PER_TOKEN + 4 * len(job.messages)
    return sum(len(p) // CHARS_PER_TOKEN + 1 if isinstance(p, str) else len(p) for p in job.prompts)


def _stream_delta(choice: dict[str, Any], kind: JobKind) -> ChoiceDelta | None:
    delta = choice.get("delta") or {}
    text = choice.get("text") if kind != CHAT else delta.get("content")
    logprobs = _logprobs(choice.get("logprobs"), kind)
    finish = choice.get("finish_reason")
    reasoning = delta.get("reasoning_content") or ""
    calls = delta.get("tool_calls") if isinstance(delta.get("tool_calls"), list) else None
    if not text and not logprobs and not finish and not reasoning and not calls:
        return None  # e.g. the role-only first chunk of a chat stream
    return ChoiceDelta(int(choice.get("index", 0)), text or "", logprobs, finish, reasoning, calls)


def _usage(raw: Any) -> Usage:
    if not isinstance(raw, dict):
        return Usage()
    details = raw.get("prompt_tokens_details") or {}
    return Usage(
        prompt_tokens=int(raw.get("prompt_tokens") or 0),
        completion_tokens=int(raw.get("completion_tokens") or 0),
        cached_tokens=int(details.get("cached_tokens") or 0),
    )


def _logprobs(raw: Any, kind: JobKind) -> list[LogprobEntry] | None:
    """Chat `{"content": [{token, logprob, top_logprobs}]}` or completions `{tokens, token_logprobs,
    top_logprobs}` into our entries."""
    if not isinstance(raw, dict):
        return None
    if kind == CHAT:
        return [
            LogprobEntry(
                item.get("token", ""),
                item.get("logprob"),
                [(alt.get("token", ""), alt.get("logprob", 0.0)) for alt in item.get("top_logprobs") or []],
            )
            for item in raw.get("content") or []
        ]
    tokens = raw.get("tokens") or []
    values = raw.get("token_logprobs") or [None] * len(tokens)
    tops = raw.get("top_logprobs") or [None] * len(tokens)
    return [
        LogprobEntry(token, value, list(top.items()) if isinstance(top, dict) else None)
        for token, value, top in zip(tokens, values, tops, strict=False)
    ]

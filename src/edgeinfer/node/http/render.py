"""Turning job deltas into the OpenAI and Workers-AI response bodies and stream events."""

from __future__ import annotations

import abc
import json
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

from edgeinfer.api.errors import ApiError
from edgeinfer.api.jobs import Job
from edgeinfer.node.backends.base import ChoiceDelta, LogprobEntry
from edgeinfer.structured.call_stream import merge_call_deltas
from edgeinfer.types import Usage

DONE = b"data: [DONE]\n\n"


def sse(data: dict[str, Any]) -> bytes:
    """One server-sent event carrying `data` as compact JSON."""
    return b"data: " + json.dumps(data, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


@dataclass
class Collected:
    """A non-streamed answer, assembled from deltas per choice index."""

    texts: dict[int, list[str]] = field(default_factory=dict)
    logprobs: dict[int, list[LogprobEntry]] = field(default_factory=dict)
    finish: dict[int, str] = field(default_factory=dict)
    reasoning: dict[int, list[str]] = field(default_factory=dict)
    tool_calls: dict[int, list[dict[str, Any]]] = field(default_factory=dict)  # stream delta items

    def add(self, delta: ChoiceDelta) -> None:
        self.texts.setdefault(delta.index, []).append(delta.text)
        if delta.reasoning:
            self.reasoning.setdefault(delta.index, []).append(delta.reasoning)
        if delta.tool_calls:
            self.tool_calls.setdefault(delta.index, []).extend(delta.tool_calls)
        if delta.logprobs is not None:
            self.logprobs.setdefault(delta.index, []).extend(delta.logprobs)
        if delta.finish_reason is not None:
            self.finish[delta.index] = delta.finish_reason

    def text(self, index: int) -> str:
        return "".join(self.texts.get(index, []))


def openai_usage(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


class Renderer(abc.ABC):
    """One API's shapes. A renderer instance serves one request (streams keep per-choice state)."""

    def __init__(self, job: Job, version: str) -> None:
        self.job = job
        self.created = int(time.time())
        self.fingerprint = f"edgeinfer-{version}" if version else None

    @abc.abstractmethod
    def response(self, collected: Collected, usage: Usage) -> dict[str, Any]: ...

    @abc.abstractmethod
    def chunk(self, delta: ChoiceDelta) -> dict[str, Any]: ...

    @abc.abstractmethod
    def final_chunks(self, usage: Usage) -> list[dict[str, Any]]: ...

    def error_event(self, error: ApiError) -> dict[str, Any]:
        return error.openai_body()


class OpenAIRenderer(Renderer):
    """What OpenAI's completions and chat share: the envelope of every body, the stream's usage field and
    final usage chunk. Subclasses name their objects and build the choices."""

    response_object: ClassVar[str]
    chunk_object: ClassVar[str]

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.job.request_id,
            "object": obj,
            "created": self.created,
            "model": self.job.model,
            "system_fingerprint": self.fingerprint,
            "choices": choices,
        }

    def _response(self, choices: list[dict[str, Any]], usage: Usage) -> dict[str, Any]:
        return {**self._envelope(self.response_object, choices), "usage": openai_usage(usage)}

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        body = self._envelope(self.chunk_object, [choice])
        if self.job.include_usage:
            body["usage"] = None
        return body

    def final_chunks(self, usage: Usage) -> list[dict[str, Any]]:
        if not self.job.include_usage:
            return []
        return [{**self._envelope(self.chunk_object, []), "usage": openai_usage(usage)}]


class CompletionRenderer(OpenAIRenderer):
    """OpenAI /v1/completions (`text_completion`)."""

    response_object = chunk_object = "text_completion"

    def __init__(self, job: Job, version: str) -> None:
        super().__init__(job, version)
        self._offsets: dict[int, int] = {}

    def response(self, collected: Collected, usage: Usage) -> dict[str, Any]:
        choices = [
            {
                "index": i,
                "text": collected.text(i),
                "logprobs": self._logprobs(i, collected.logprobs.get(i, []))
                if self.job.logprobs is not None
                else None,
                "finish_reason": collected.finish.get(i),
            }
            for i in range(self.job.num_choices)
        ]
        return self._response(choices, usage)

    def chunk(self, delta: ChoiceDelta) -> dict[str, Any]:
        choice = {
            "index": delta.index,
            "text": delta.text,
            "logprobs": self._logprobs(delta.index, delta.logprobs or [])
            if self.job.logprobs is not None
            else None,
            "finish_reason": delta.finish_reason,
        }
        return self._chunk(choice)

    def _logprobs(self, index: int, entries: list[LogprobEntry]) -> dict[str, Any]:
        """Legacy completions logprobs; `text_offset` indexes into the choice's returned text."""
        offsets = []
        position = self._offsets.get(index, 0)
        for entry in entries:
            offsets.append(position)
            position += len(entry.token)
        self._offsets[index] = position
        return {
            "tokens": [e.token for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [
                dict(e.top) if e.top is not None and e.logprob is not None else None for e in entries
            ],
            "text_offset": offsets,
        }


class ChatRenderer(OpenAIRenderer):
    """OpenAI /v1/chat/completions (`chat.completion` and `chat.completion.chunk`)."""

    response_object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(self, job: Job, version: str) -> None:
        super().__init__(job, version)
        self._started: set[int] = set()

    def response(self, collected: Collected, usage: Usage) -> dict[str, Any]:
        choices = [
            {
                "index": i,
                "message": _chat_message(collected, i),
                "logprobs": _chat_logprobs(collected.logprobs.get(i, []))
                if self.job.logprobs is not None
                else None,
                "finish_reason": collected.finish.get(i),
            }
            for i in range(self.job.num_choices)
        ]
        return self._response(choices, usage)

    def chunk(self, delta: ChoiceDelta) -> dict[str, Any]:
        message: dict[str, Any] = {"content": delta.text}
        if delta.reasoning:
            message["reasoning_content"] = delta.reasoning
        if delta.tool_calls:
            message["tool_calls"] = delta.tool_calls
        if delta.index not in self._started:
            self._started.add(delta.index)
            message = {"role": "assistant", **message}
        choice = {
            "index": delta.index,
            "delta": message,
            "logprobs": _chat_logprobs(delta.logprobs or []) if self.job.logprobs is not None else None,
            "finish_reason": delta.finish_reason,
        }
        return self._chunk(choice)


class WorkersAIRenderer(Renderer):
    """Workers-AI text generation: `{"result": {"response", "usage"}, "success": true, ...}`; streams send
    `{"response": "..."}` events, then one with the usage, then `[DONE]`."""

    def response(self, collected: Collected, usage: Usage) -> dict[str, Any]:
        return {
            "result": {"response": collected.text(0), "usage": openai_usage(usage)},
            "success": True,
            "errors": [],
            "messages": [],
        }

    def chunk(self, delta: ChoiceDelta) -> dict[str, Any]:
        return {"response": delta.text}

    def final_chunks(self, usage: Usage) -> list[dict[str, Any]]:
        return [{"response": "", "usage": openai_usage(usage)}]

    def error_event(self, error: ApiError) -> dict[str, Any]:
        return error.workers_ai_body()


def _chat_message(collected: Collected, index: int) -> dict[str, Any]:
    """The assistant message: content (None when the answer is only tool calls), reasoning, calls."""
    message: dict[str, Any] = {"role": "assistant", "content": collected.text(index)}
    if index in collected.reasoning:
        message["reasoning_content"] = "".join(collected.reasoning[index])
    if calls := merge_call_deltas(collected.tool_calls.get(index, [])):
        message["tool_calls"] = calls
        message["content"] = message["content"] or None
    return message


def _chat_logprobs(entries: list[LogprobEntry]) -> dict[str, Any]:
    return {
        "content": [
            {
                "token": e.token,
                "logprob": e.logprob,
                "bytes": list(e.token.encode("utf-8")),
                "top_logprobs": [
                    {"token": t, "logprob": v, "bytes": list(t.encode("utf-8"))} for t, v in (e.top or [])
                ],
            }
            for e in entries
        ]
    }

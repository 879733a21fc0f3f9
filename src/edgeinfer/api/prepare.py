"""API request bodies → `Job`s, enforcing the server's per-request limits (400 with a clear message)."""

from __future__ import annotations

import time
import uuid
from typing import Any

from edgeinfer.api.errors import bad_request
from edgeinfer.api.jobs import CHAT, COMPLETION, Job
from edgeinfer.api.limits import NodeLimits
from edgeinfer.api.sampling import (
    check_logprobs,
    choices,
    reject_if_busy,
    sampling_params,
    workers_ai_sampling_params,
)
from edgeinfer.api.schemas import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    WorkersAIRunRequest,
)
from edgeinfer.structured.grammar import GrammarError, response_format_grammar
from edgeinfer.structured.tools import parse_tool_choice, parse_tools

OPENAI_DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's documented default for /v1/completions


def refuse_tools(raw: dict[str, Any], route: str) -> None:
    """Tools are a chat feature: the other routes refuse them with a 400 rather than ignoring them."""
    if raw.get("tools"):
        raise bad_request(f"tools are supported on /v1/chat/completions only, not on {route}", "tools")


def completion_job(body: CompletionRequest, raw: dict[str, Any], limits: NodeLimits) -> Job:
    refuse_tools(raw, "/v1/completions")
    if body.suffix:
        raise bad_request("suffix is not supported", "suffix")
    prompts = _prompts(body.prompt)
    check_logprobs(body.logprobs, limits, "logprobs")
    max_tokens = body.max_tokens or OPENAI_DEFAULT_COMPLETION_TOKENS
    return Job(
        request_id=_new_id("cmpl"),
        endpoint="completions",
        kind=COMPLETION,
        model=body.model,
        sampling=sampling_params(body, limits, max_tokens, body.logprobs, _grammar(body.response_format)),
        max_tokens=max_tokens,
        max_tokens_explicit=body.max_tokens is not None,
        arrival=time.monotonic(),
        prompts=prompts,
        n=choices(body, limits, len(prompts)),
        echo=body.echo,
        logprobs=body.logprobs,
        stream=body.stream,
        include_usage=bool(body.stream and body.stream_options and body.stream_options.include_usage),
        reject_if_busy=reject_if_busy(body),
        priority=body.priority,
        upstream_path="/v1/completions",
        upstream_body=raw,
    )


def chat_job(body: ChatCompletionRequest, raw: dict[str, Any], limits: NodeLimits) -> Job:
    tools, choice = _tools(body)
    grammar = _grammar(body.response_format)
    if grammar is not None and choice.forced:
        raise bad_request(
            "tool_choice required or a named function cannot be combined with a JSON response_format",
            "tool_choice",
        )
    logprobs = None
    if body.logprobs:
        logprobs = body.top_logprobs or 0
        check_logprobs(logprobs, limits, "top_logprobs")
    elif body.top_logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    max_tokens = body.max_completion_tokens or body.max_tokens
    return Job(
        request_id=_new_id("chatcmpl"),
        endpoint="chat.completions",
        kind=CHAT,
        model=body.model,
        sampling=sampling_params(body, limits, max_tokens or limits.max_tokens, logprobs, grammar),
        max_tokens=max_tokens,
        max_tokens_explicit=max_tokens is not None,
        arrival=time.monotonic(),
        messages=_messages(body.messages),
        tools=[t.as_openai() for t in tools] if choice.enabled else [],
        tool_choice=choice,
        parallel_tool_calls=body.parallel_tool_calls,
        template_kwargs=dict(body.chat_template_kwargs or {}),
        n=choices(body, limits, 1),
        logprobs=logprobs,
        stream=body.stream,
        include_usage=bool(body.stream and body.stream_options and body.stream_options.include_usage),
        reject_if_busy=reject_if_busy(body),
        priority=body.priority,
        upstream_path="/v1/chat/completions",
        upstream_body=raw,
    )


def check_one_workers_ai_input(body: WorkersAIRunRequest) -> None:
    """The Workers-AI body carries one input: `prompt` or `messages` (generation), or `text` (embeddings).
    Checked before the model's task is known, by nodes and routers alike, with one message."""
    if sum(field is not None for field in (body.prompt, body.messages, body.text)) > 1:
        raise bad_request("send exactly one of `prompt`, `messages` (text generation) or `text` (embeddings)")


def workers_ai_job(model: str, body: WorkersAIRunRequest, raw: dict[str, Any], limits: NodeLimits) -> Job:
    """`prompt` is wrapped as one user message in the chat template unless `raw` is true."""
    refuse_tools(raw, "the Workers-AI route")
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("send exactly one of `prompt` or `messages`")
    max_tokens = body.max_tokens or limits.workers_ai_default_max_tokens
    if body.max_tokens is not None and body.max_tokens > limits.max_tokens:
        raise bad_request(f"max_tokens must be <= {limits.max_tokens}", "max_tokens")
    params = workers_ai_sampling_params(body, max_tokens, _grammar(body.response_format))
    job = Job(
        request_id=_new_id("wai"),
        endpoint="ai.run",
        kind=CHAT,
        model=model,
        sampling=params,
        max_tokens=max_tokens,
        max_tokens_explicit=body.max_tokens is not None,
        arrival=time.monotonic(),
        stream=body.stream,
        include_usage=True,
        reject_if_busy=bool(body.options and body.options.reject_if_busy),
        adapter=body.lora,
    )
    fields = _openai_fields(body, max_tokens)
    if body.response_format is not None:
        fields["response_format"] = body.response_format
    if body.prompt is not None and body.raw:
        job.kind, job.prompts = COMPLETION, [body.prompt]
        job.upstream_path, job.upstream_body = "/v1/completions", {**fields, "prompt": body.prompt}
    else:
        messages = (
            _messages(body.messages)
            if body.messages is not None
            else [{"role": "user", "content": body.prompt}]
        )
        job.messages = messages
        job.upstream_path, job.upstream_body = "/v1/chat/completions", {**fields, "messages": messages}
    return job


def _new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("prompt must not be empty", "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]  # one prompt given as token ids
    return list(prompt)


def _messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    out = []
    for i, message in enumerate(messages):
        content = message.content
        if isinstance(content, list):
            if any(part.type != "text" for part in content):
                raise bad_request(f"messages[{i}]: only text content parts are supported", "messages")
            content = "".join(part.text or "" for part in content)
        role = "system" if message.role == "developer" else message.role
        item: dict[str, Any] = {"role": role, "content": content or ""}
        extras = {
            "tool_calls": message.tool_calls,
            "tool_call_id": message.tool_call_id,
            "name": message.name if role == "tool" else None,
            "reasoning_content": message.reasoning_content,
        }
        item.update({k: v for k, v in extras.items() if v is not None})
        out.append(item)
    return out


def _tools(body: ChatCompletionRequest) -> tuple[list[Any], Any]:
    try:
        tools = parse_tools(body.tools)
        choice = parse_tool_choice(body.tool_choice, tools)
    except ValueError as exc:
        param = "tool_choice" if "tool_choice" in str(exc) else "tools"
        raise bad_request(str(exc), param) from None
    return tools, choice


def _grammar(response_format: dict[str, Any] | None) -> str | None:
    """The grammar of a response_format; an invalid or unsupported one is a 400 naming the problem."""
    try:
        return response_format_grammar(response_format)
    except GrammarError as exc:
        raise bad_request(f"response_format: {exc}", "response_format") from None


def _openai_fields(body: WorkersAIRunRequest, max_tokens: int) -> dict[str, Any]:
    """The sampling fields of a Workers-AI body, spelled for an upstream OpenAI-compatible server."""
    names = (
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "repetition_penalty",
        "frequency_penalty",
        "presence_penalty",
    )
    fields: dict[str, Any] = {name: getattr(body, name) for name in names if getattr(body, name) is not None}
    fields["max_tokens"] = max_tokens
    return fields

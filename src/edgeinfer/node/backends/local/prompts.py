"""A job's prompts as the engine will see them: tokenized, checked as the engine checks them (a 400 before
the stream starts, not an error event), their output budget fitted to the context, and the sampling fields
tools need."""

from __future__ import annotations

import dataclasses
from typing import Any

from edgeinfer.api.errors import bad_request
from edgeinfer.api.jobs import CHAT, Job
from edgeinfer.api.limits import NodeLimits
from edgeinfer.structured.grammar import GrammarError, lark_grammar
from edgeinfer.structured.tools import Tool
from edgeinfer.types import SamplingParams
from edgeinfer.types.validation import InvalidInput, check_prompt


def tokenize(job: Job, tok: Any, ctx: int) -> list[tuple[list[int], str]]:
    """Each prompt's token ids and text, checked as the engine will check them (`ctx`: the context)."""
    if job.kind == CHAT:
        return [_chat_prompt(job, tok, ctx)]
    out: list[tuple[list[int], str]] = []
    for prompt in job.prompts:
        if isinstance(prompt, str):
            ids = tok.encode(prompt, add_special_tokens=True)
            _check_prompt(ids, tok.vocab_size, ctx)
            out.append((ids, prompt))
        else:
            _check_prompt(prompt, tok.vocab_size, ctx)  # before decoding ids outside the vocabulary
            out.append((list(prompt), tok.decode(prompt, skip_special_tokens=False)))
    return out


def _chat_prompt(job: Job, tok: Any, ctx: int) -> tuple[list[int], str]:
    try:
        text = tok.apply_chat_template(
            job.messages, True, tools=job.tools or None, template_kwargs=job.template_kwargs
        )
    except ValueError as exc:  # messages the template refuses (roles, order, emptiness)
        raise bad_request(str(exc), "messages") from None
    # The chat template already holds the special tokens (BOS) the model expects.
    ids = tok.encode(text, add_special_tokens=False)
    _check_prompt(ids, tok.vocab_size, ctx)
    return ids, text


def max_tokens(job: Job, prompt_len: int, ctx: int, limits: NodeLimits) -> int:
    """The choice's output budget: the job's, within the server's limits and the context left."""
    if prompt_len > limits.max_prompt_tokens:
        raise bad_request(
            f"the prompt has {prompt_len} tokens, above this server's limit of {limits.max_prompt_tokens}"
        )
    room = ctx - prompt_len
    if job.max_tokens is None:
        return min(limits.max_tokens, room)
    if not job.max_tokens_explicit:
        return min(job.max_tokens, room)
    if job.max_tokens > room:
        raise bad_request(
            f"this model's maximum context length is {ctx} tokens; the prompt has {prompt_len} tokens "
            f"and max_tokens is {job.max_tokens}",
            "max_tokens",
        )
    return job.max_tokens


def tool_sampling(job: Job, tok: Any) -> dict[str, Any]:
    """With tools, special tokens stay in the text (calls are marked with them); a forced choice
    constrains the answer to the family's call format with the tools' argument schemas."""
    if not job.tools:
        return {}
    fields: dict[str, Any] = {"skip_special_tokens": False}
    if job.tool_choice.forced:
        tools = [Tool(t["function"]["name"], "", t["function"]["parameters"]) for t in job.tools]
        fmt = tok.tool_format
        try:
            lark = fmt.grammar(tools, job.tool_choice, job.parallel_tool_calls, tok.token_ref)
            fields["grammar"] = lark_grammar(lark)
        except GrammarError as exc:
            raise bad_request(f"tools cannot be forced in the {fmt.name} format: {exc}", "tools") from None
    return fields


def with_changes(sampling: SamplingParams, **changes: Any) -> SamplingParams:
    """A copy with `changes`, validated again (e.g. min_tokens above a max_tokens cut to the context)."""
    try:
        return dataclasses.replace(sampling, **changes)
    except ValueError as exc:
        raise bad_request(str(exc)) from None


def _check_prompt(ids: list[int], vocab_size: int, ctx: int) -> None:
    """The engine's own prompt check (types/validation.py), here before the stream starts so that a bad
    prompt gets a 400 rather than an error event."""
    try:
        check_prompt(ids, vocab_size, ctx)
    except InvalidInput as exc:
        raise bad_request(str(exc), exc.param) from None

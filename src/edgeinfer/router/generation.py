"""What the router needs of a generation request to place it and hold its tokens against the tenant's
limits: the model, the LoRA adapter it names, and the most it may generate (all choices together).

They are read straight off the parsed body where those fields are plainly well formed; the node that runs
the request judges all of it with its schemas (api/), so a request is validated in full once, where it
runs, and a malformed one gets the node's own 400, relayed. A body whose routing fields are not plain (no
model, a max_tokens that is not a positive integer, a prompt of no known shape) is judged here by the
same schemas and request builders instead, so that what cannot be placed gets the node's answer without
being forwarded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from edgeinfer.api.jobs import Job
from edgeinfer.api.limits import NodeLimits
from edgeinfer.api.prepare import OPENAI_DEFAULT_COMPLETION_TOKENS


@dataclass(frozen=True)
class Generation:
    model: str
    adapter: str | None
    output_tokens: int  # the most it may generate, all choices together


def of_job(job: Job, limits: NodeLimits) -> Generation:
    """A fully validated request's (the node reserves the same)."""
    return Generation(job.model, job.adapter, job.num_choices * (job.max_tokens or limits.max_tokens))


def completion(value: Any, limits: NodeLimits) -> Generation | None:
    if not isinstance(value, dict) or not isinstance(model := value.get("model"), str):
        return None
    max_tokens, n = _count(value, "max_tokens"), _count(value, "n")
    prompts = _num_prompts(value.get("prompt"))
    if max_tokens is None or n is None or prompts is None:
        return None
    return Generation(model, None, (n or 1) * prompts * (max_tokens or OPENAI_DEFAULT_COMPLETION_TOKENS))


def chat(value: Any, limits: NodeLimits) -> Generation | None:
    if not isinstance(value, dict) or not isinstance(model := value.get("model"), str):
        return None
    counts = _count(value, "max_completion_tokens"), _count(value, "max_tokens"), _count(value, "n")
    if None in counts:
        return None
    max_completion_tokens, max_tokens, n = counts
    return Generation(model, None, (n or 1) * (max_completion_tokens or max_tokens or limits.max_tokens))


def workers_ai(model: str, value: Any, limits: NodeLimits) -> Generation | None:
    if not isinstance(value, dict) or not isinstance(adapter := value.get("lora"), str | None):
        return None
    max_tokens = _count(value, "max_tokens")
    if max_tokens is None:
        return None
    return Generation(model, adapter, max_tokens or limits.workers_ai_default_max_tokens)


def _count(value: dict[str, Any], name: str) -> int | None:
    """A positive integer field: its value, 0 where it is absent or null, None where it is anything else."""
    count = value.get(name)
    if count is None:
        return 0
    return count if type(count) is int and count > 0 else None


def _num_prompts(prompt: Any) -> int | None:
    """How many prompts /v1/completions' `prompt` holds: one text, one list of token ids, or a list of
    either; None for anything else."""
    if isinstance(prompt, str):
        return 1
    if not isinstance(prompt, list) or not prompt:
        return None
    if all(type(p) is int for p in prompt):
        return 1
    return len(prompt) if all(isinstance(p, str | list) for p in prompt) else None

"""Request fields → `SamplingParams`, under the server's per-request limits (400 naming the field)."""

from __future__ import annotations

from typing import Any

from edgeinfer.api.errors import bad_request
from edgeinfer.api.limits import NodeLimits
from edgeinfer.api.schemas import SamplingFields, WorkersAIRunRequest
from edgeinfer.types import SamplingParams


def choices(body: SamplingFields, limits: NodeLimits, num_prompts: int) -> int:
    """`n`, choices per prompt: `best_of` may only repeat it, and n × prompts stays within `max_n`."""
    if body.best_of is not None and body.best_of != body.n:
        raise bad_request("best_of must equal n (this server returns every sampled choice)", "best_of")
    if body.n * num_prompts > limits.max_n:
        raise bad_request(f"n × prompts must be <= {limits.max_n}", "n")
    return body.n


def check_logprobs(value: int | None, limits: NodeLimits, param: str) -> None:
    if value is not None and value > limits.max_top_logprobs:
        raise bad_request(f"{param} must be <= {limits.max_top_logprobs}", param)


def _stops(stop: str | list[str] | None, limits: NodeLimits) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > limits.max_stop:
        raise bad_request(f"at most {limits.max_stop} stop sequences are allowed", "stop")
    if any(not s for s in stops):
        raise bad_request("stop sequences must be non-empty strings", "stop")
    return stops


def reject_if_busy(body: SamplingFields) -> bool:
    return bool(body.options and body.options.reject_if_busy)


def sampling_params(
    body: SamplingFields, limits: NodeLimits, max_tokens: int, logprobs: int | None, grammar: str | None
) -> SamplingParams:
    if body.logit_bias:
        raise bad_request("logit_bias is not supported", "logit_bias")
    if max_tokens > limits.max_tokens:
        raise bad_request(f"max_tokens must be <= {limits.max_tokens}", "max_tokens")
    return _params(
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_k=body.top_k or 0,
        top_p=1.0 if body.top_p is None else body.top_p,
        min_p=body.min_p or 0.0,
        repetition_penalty=body.repetition_penalty or 1.0,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        seed=body.seed,
        stop=_stops(body.stop, limits),
        stop_token_ids=list(body.stop_token_ids or []),
        ignore_eos=body.ignore_eos,
        min_tokens=body.min_tokens,
        logprobs=logprobs,
        include_stop_str_in_output=body.include_stop_str_in_output,
        grammar=grammar,
        speculative=body.speculative,
    )


def workers_ai_sampling_params(
    body: WorkersAIRunRequest, max_tokens: int, grammar: str | None
) -> SamplingParams:
    # Workers AI documents temperature 0.6 as the text-generation default.
    return _params(
        max_tokens=max_tokens,
        temperature=0.6 if body.temperature is None else body.temperature,
        top_k=body.top_k or 0,
        top_p=1.0 if body.top_p is None else body.top_p,
        repetition_penalty=body.repetition_penalty or 1.0,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        seed=body.seed,
        grammar=grammar,
    )


def _params(**kwargs: Any) -> SamplingParams:
    try:
        return SamplingParams(**kwargs)
    except ValueError as exc:  # SamplingParams names the field in its message
        raise bad_request(str(exc)) from None

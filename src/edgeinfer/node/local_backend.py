"""Runs jobs on a resident `AsyncLLMEngine`: tokenize, fan out n choices, merge their deltas."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import AsyncGenerator
from typing import Any

from edgeinfer.node.config import NodeLimits
from edgeinfer.node.errors import ApiError, bad_request, internal
from edgeinfer.node.jobs import CHAT, Backend, ChoiceDelta, Job, LogprobEntry, Outcome
from edgeinfer.node.tenants import Tenant
from edgeinfer.obs.canary import DEGENERATE_REPETITION, NONFINITE_LOGITS, is_degenerate_repetition
from edgeinfer.obs.timing import LatencyBreakdown
from edgeinfer.pool.member import LocalMember
from edgeinfer.structured.grammar import GrammarError, lark_grammar
from edgeinfer.structured.stream import THINK_OPEN, AnswerParser, Parts
from edgeinfer.structured.tools import Tool
from edgeinfer.types import EngineRequest, FinishReason, RequestOutput, SamplingParams, TokenLogprob, Usage
from edgeinfer.types.sampling import choice_seed
from edgeinfer.types.validation import InvalidInput, check_prompt

logger = logging.getLogger("edgeinfer.node")

_FINISH = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.ABORT: "abort"}


@dataclasses.dataclass
class _Choice:
    """Per-choice progress while merging engine streams."""

    request: EngineRequest
    prompt_text: str
    echoed: bool = False
    finished: bool = False
    last_token_at: float | None = None
    usage: Usage | None = None  # cumulative, from the latest engine output
    token_ids: list[int] = dataclasses.field(default_factory=list)
    parser: AnswerParser | None = None  # chat answers: reasoning / content / tool calls
    num_calls: int = 0

    def take_usage(self, usage: Usage) -> None:
        """The engine's own count, given when the stream closed before its end."""
        self.usage = usage


class LocalBackend(Backend):
    def __init__(self, member: LocalMember, limits: NodeLimits, tenant: Tenant) -> None:
        self._member = member
        self._engine = member.engine
        self._tokenizer = member.tokenizer
        self._limits = limits
        self._tenant = tenant
        self._choices: list[_Choice] = []
        self._pieces: dict[int, str] = {}
        self.version = member.version

    def prepare(self, job: Job) -> int:
        ctx = self._member.max_model_len
        prompts = self._tokenize(job, ctx)
        reserve = 0
        tool_fields = self._tool_sampling(job)
        for p, (ids, text) in enumerate(prompts):
            max_tokens = self._max_tokens(job, len(ids), ctx)
            echo_logprobs = job.logprobs if job.echo else None
            sampling = _replace(
                job.sampling, max_tokens=max_tokens, prompt_logprobs=echo_logprobs, **tool_fields
            )
            for i in range(job.n):
                request = EngineRequest(
                    request_id=f"{job.request_id}-{p * job.n + i}",
                    prompt_token_ids=ids,
                    sampling=_replace(sampling, seed=choice_seed(sampling.seed, i)),
                    tenant=self._tenant.name,
                    model=self._member.name,
                    arrival_time=job.arrival,
                    cache_namespace=self._tenant.cache_namespace,
                    tenant_weight=self._tenant.weight,
                    cache_share=self._tenant.cache_share,
                )
                self._choices.append(_Choice(request, text, parser=self._parser(job, text)))
            reserve += len(ids) + job.n * max_tokens
        return reserve

    def _tool_sampling(self, job: Job) -> dict[str, Any]:
        """With tools, special tokens stay in the text (calls are marked with them); a forced choice
        constrains the answer to the family's call format with the tools' argument schemas."""
        if not job.tools:
            return {}
        fields: dict[str, Any] = {"skip_special_tokens": False}
        if job.tool_choice.forced:
            tools = [Tool(t["function"]["name"], "", t["function"]["parameters"]) for t in job.tools]
            fmt = self._tokenizer.tool_format
            try:
                lark = fmt.grammar(tools, job.tool_choice, job.parallel_tool_calls, self._tokenizer.token_ref)
                fields["grammar"] = lark_grammar(lark)
            except GrammarError as exc:
                raise bad_request(
                    f"tools cannot be forced in the {fmt.name} format: {exc}", "tools"
                ) from None
        return fields

    def _parser(self, job: Job, prompt: str) -> AnswerParser | None:
        tok = self._tokenizer
        if job.kind != CHAT or not (job.tools or tok.reasons):
            return None
        opened = tok.reasons and prompt.rstrip().endswith(THINK_OPEN)  # the template opened the block
        return AnswerParser(tok.tool_format if job.tools else None, tok.reasons, in_reasoning=opened)

    def _tokenize(self, job: Job, ctx: int) -> list[tuple[list[int], str]]:
        """Each prompt's token ids and text, checked as the engine will check them (`ctx`: the context)."""
        tok = self._tokenizer
        if job.kind == CHAT:
            try:
                text = tok.apply_chat_template(
                    job.messages, True, tools=job.tools or None, template_kwargs=job.template_kwargs
                )
            except ValueError as exc:  # messages the template refuses (roles, order, emptiness)
                raise bad_request(str(exc), "messages") from None
            # The chat template already holds the special tokens (BOS) the model expects.
            ids = tok.encode(text, add_special_tokens=False)
            _check_prompt(ids, tok.vocab_size, ctx)
            return [(ids, text)]
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

    def _max_tokens(self, job: Job, prompt_len: int, ctx: int) -> int:
        if prompt_len > self._limits.max_prompt_tokens:
            raise bad_request(
                f"the prompt has {prompt_len} tokens, above this server's limit of "
                f"{self._limits.max_prompt_tokens}"
            )
        room = ctx - prompt_len
        if job.max_tokens is None:
            return min(self._limits.max_tokens, room)
        if not job.max_tokens_explicit:
            return min(job.max_tokens, room)
        if job.max_tokens > room:
            raise bad_request(
                f"this model's maximum context length is {ctx} tokens; the prompt has {prompt_len} tokens "
                f"and max_tokens is {job.max_tokens}",
                "max_tokens",
            )
        return job.max_tokens

    async def run(self, job: Job, outcome: Outcome) -> AsyncGenerator[ChoiceDelta, None]:
        outcome.version = self.version
        first = True
        try:
            async with contextlib.aclosing(self._outputs()) as outputs:
                async for index, item in outputs:
                    if first and item.new_token_ids:
                        first = False
                        await self._hold_first_token(job, item)
                    deltas = self._deltas(job, index, item, outcome)
                    outcome.usage = self._total_usage(job.n)  # read by the usage checkpoints meanwhile
                    for delta in deltas:
                        yield delta
        finally:
            for choice in self._choices:
                if not choice.finished:
                    self._engine.abort(choice.request.request_id)
            # Billed even when cut short: what the engine did compute for each choice so far.
            outcome.usage = self._total_usage(job.n)

    async def _hold_first_token(self, job: Job, item: RequestOutput) -> None:
        """Timing hygiene (NodeLimits.ttft_bucket_ms): every first token waits for its bucket's end.
        Every one, not only hits': held alone, hits land on bucket ends while misses do not, which tells
        them apart as surely as speed does (measured: a same-tenant AUC of 0.38 with hits alone held)."""
        bucket = self._limits.ttft_bucket_ms / 1000.0
        if bucket <= 0:
            return
        elapsed = time.monotonic() - job.arrival
        await asyncio.sleep(math.ceil(elapsed / bucket) * bucket - elapsed)

    def _total_usage(self, n: int) -> Usage:
        total = Usage()
        for index, choice in enumerate(self._choices):
            if choice.usage is None:
                continue
            if index % n == 0:
                # The n choices of a prompt share it: its tokens are counted once, from the first choice.
                total.prompt_tokens += choice.usage.prompt_tokens
                total.cached_tokens += choice.usage.cached_tokens
            total.completion_tokens += choice.usage.completion_tokens
        return total

    async def _outputs(self) -> AsyncGenerator[tuple[int, RequestOutput], None]:
        """Every choice's engine outputs as (choice index, output), in arrival order, until all finish.

        One choice (the common case) reads its engine stream directly: a pump task and a merge queue
        would add two task switches to every token's path through the event loop."""
        if len(self._choices) == 1:
            try:
                generation = self._engine.generate(self._choices[0].request, self._choices[0].take_usage)
                async with contextlib.aclosing(generation) as stream:
                    async for output in stream:
                        yield 0, output
            except Exception as exc:
                raise _as_api_error(exc) from None
            return
        merged: asyncio.Queue[tuple[int, RequestOutput | BaseException]] = asyncio.Queue()
        pumps = [asyncio.create_task(self._pump(i, c.request, merged)) for i, c in enumerate(self._choices)]
        remaining = len(self._choices)
        try:
            while remaining:
                index, item = await merged.get()
                if isinstance(item, BaseException):
                    raise _as_api_error(item)
                remaining -= item.finished
                yield index, item
        finally:
            for task in pumps:
                task.cancel()
            # each pump's stream learns the engine's final count as it closes: waited for, so it is billed
            await asyncio.gather(*pumps, return_exceptions=True)

    async def _pump(self, index: int, request: EngineRequest, merged: asyncio.Queue[Any]) -> None:
        # The engine never waits on us: it fills the generator's own queue, and this task moves
        # deltas into an unbounded merge queue (bounded in practice by max_tokens).
        try:
            async for output in self._engine.generate(request, self._choices[index].take_usage):
                merged.put_nowait((index, output))
        except Exception as exc:
            merged.put_nowait((index, exc))

    def _deltas(self, job: Job, index: int, out: RequestOutput, outcome: Outcome) -> list[ChoiceDelta]:
        choice = self._choices[index]
        choice.usage = out.usage
        if choice.finished:  # ended here (a repeated tool call): what the engine made since is billed only
            return []
        deltas: list[ChoiceDelta] = []
        if job.echo and not choice.echoed and self._echo_ready(job, out):
            choice.echoed = True
            deltas.append(self._echo_delta(job, index, choice, out))
        now = time.monotonic()
        if out.new_token_ids:
            self._observe_tokens(choice, out.new_token_ids, now, job, outcome)
        logprobs = self._entries(out.logprobs) if job.logprobs is not None else None
        delta = self._parsed(choice, index, out.text_delta, out.finished)
        repeated = choice.parser is not None and choice.parser.repeated
        if repeated and not out.finished:
            self._engine.abort(choice.request.request_id)  # its final output arrives and is passed over
        finish = self._finish(job, index, out, outcome, now) if out.finished or repeated else None
        delta.logprobs, delta.finish_reason = logprobs, finish
        if choice.num_calls and (finish == "stop" or repeated):
            delta.finish_reason = "tool_calls"
        if delta.text or delta.reasoning or delta.tool_calls or logprobs or finish:
            deltas.append(delta)
        return deltas

    @staticmethod
    def _parsed(choice: _Choice, index: int, text: str, finished: bool) -> ChoiceDelta:
        if choice.parser is None:
            return ChoiceDelta(index, text)
        parts = choice.parser.feed(text)
        if finished or choice.parser.repeated:
            end = choice.parser.finish()
            calls = parts.tool_calls + end.tool_calls
            parts = Parts(parts.reasoning + end.reasoning, parts.content + end.content, calls)
        calls = parts.tool_calls
        choice.num_calls += len({item["index"] for item in calls if "id" in item})
        return ChoiceDelta(index, parts.content, reasoning=parts.reasoning, tool_calls=calls or None)

    @staticmethod
    def _echo_ready(job: Job, out: RequestOutput) -> bool:
        # Prompt logprobs arrive with the first output that carries a token; the echo waits for them.
        return (
            job.logprobs is None or out.prompt_logprobs is not None or bool(out.new_token_ids) or out.finished
        )

    def _echo_delta(self, job: Job, index: int, choice: _Choice, out: RequestOutput) -> ChoiceDelta:
        if job.logprobs is None:
            return ChoiceDelta(index, choice.prompt_text)
        ids = choice.request.prompt_token_ids
        given = out.prompt_logprobs or []
        entries = [
            self._entry(given[i])
            if i < len(given) and given[i] is not None
            else LogprobEntry(self._piece(t), None)
            for i, t in enumerate(ids)
        ]
        return ChoiceDelta(index, choice.prompt_text, entries)

    def _observe_tokens(
        self, choice: _Choice, ids: list[int], now: float, job: Job, outcome: Outcome
    ) -> None:
        if choice.last_token_at is None:
            ttft = now - job.arrival
            if outcome.latency.ttft is None or ttft < outcome.latency.ttft:
                outcome.latency = dataclasses.replace(outcome.latency, ttft=ttft)
        else:
            gap = (now - choice.last_token_at) / len(ids)
            outcome.inter_token_latencies.extend([gap] * len(ids))
        choice.last_token_at = now
        choice.token_ids.extend(ids)

    def _finish(self, job: Job, index: int, out: RequestOutput, outcome: Outcome, now: float) -> str:
        choice = self._choices[index]
        choice.finished = True
        if out.finish_reason == FinishReason.ERROR:
            outcome.canary.append(NONFINITE_LOGITS)
            raise internal(f"generation failed for choice {index}: {out.error or 'engine error'}")
        latency = outcome.latency
        if index == 0:
            tl = out.timeline
            latency = LatencyBreakdown.from_timestamps(
                tl.arrival, tl.first_scheduled, tl.first_token, tl.finished
            )
        # ttft and e2e are what the client sees: first token of any choice, last token of all.
        outcome.latency = dataclasses.replace(latency, ttft=outcome.latency.ttft, e2e=now - job.arrival)
        if DEGENERATE_REPETITION not in outcome.canary and is_degenerate_repetition(choice.token_ids):
            outcome.canary.append(DEGENERATE_REPETITION)
        return _FINISH.get(out.finish_reason or FinishReason.STOP, "stop")

    def _entries(self, logprobs: list[TokenLogprob]) -> list[LogprobEntry]:
        return [self._entry(lp) for lp in logprobs]

    def _entry(self, lp: TokenLogprob) -> LogprobEntry:
        return LogprobEntry(self._piece(lp.token_id), lp.logprob, [(self._piece(t), v) for t, v in lp.top])

    def _piece(self, token_id: int) -> str:
        piece = self._pieces.get(token_id)
        if piece is None:
            piece = self._tokenizer.decode([token_id], skip_special_tokens=False)
            self._pieces[token_id] = piece
        return piece


def _replace(sampling: SamplingParams, **changes: Any) -> SamplingParams:
    """A copy with `changes`, validated again (e.g. min_tokens above a max_tokens cut to the context)."""
    try:
        return dataclasses.replace(sampling, **changes)
    except ValueError as exc:
        raise bad_request(str(exc)) from None


def _as_api_error(exc: BaseException) -> ApiError:
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, ValueError):  # EngineInputError: the request itself is unservable
        return bad_request(str(exc))
    logger.error("engine failure", exc_info=exc)
    return internal("internal error in the engine; the server log has the details")


def _check_prompt(ids: list[int], vocab_size: int, ctx: int) -> None:
    """The engine's own prompt check (types/validation.py), here before the stream starts so that a bad
    prompt gets a 400 rather than an error event."""
    try:
        check_prompt(ids, vocab_size, ctx)
    except InvalidInput as exc:
        raise bad_request(str(exc), exc.param) from None

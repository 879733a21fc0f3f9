"""Runs jobs on a resident `AsyncLLMEngine`: tokenize, fan out n choices, merge their deltas."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator

from edgeinfer.api.jobs import Job
from edgeinfer.api.limits import NodeLimits
from edgeinfer.api.tenants import Tenant
from edgeinfer.node.backends.base import Backend, ChoiceDelta, Outcome
from edgeinfer.node.backends.local.answers import answer_parser, parse_answer
from edgeinfer.node.backends.local.choice import Choice
from edgeinfer.node.backends.local.echo import echo_delta, echo_ready
from edgeinfer.node.backends.local.finish import finish_choice
from edgeinfer.node.backends.local.logprobs import Pieces
from edgeinfer.node.backends.local.prompts import max_tokens, tokenize, tool_sampling, with_changes
from edgeinfer.node.backends.local.streams import engine_outputs
from edgeinfer.node.backends.local.timing import hold_first_token, observe_tokens
from edgeinfer.node.backends.local.usage import total_usage
from edgeinfer.pool.member import LocalMember
from edgeinfer.types import EngineRequest, RequestOutput, SamplingParams
from edgeinfer.types.sampling import choice_seed


class LocalBackend(Backend):
    def __init__(self, member: LocalMember, limits: NodeLimits, tenant: Tenant) -> None:
        self._member = member
        self._engine = member.engine
        self._tokenizer = member.tokenizer
        self._limits = limits
        self._tenant = tenant
        self._choices: list[Choice] = []
        self._pieces = Pieces(member.tokenizer)
        self.version = member.version

    def prepare(self, job: Job) -> int:
        ctx = self._member.max_model_len
        prompts = tokenize(job, self._tokenizer, ctx)
        reserve = 0
        tool_fields = tool_sampling(job, self._tokenizer)
        for p, (ids, text) in enumerate(prompts):
            budget = max_tokens(job, len(ids), ctx, self._limits)
            echo_logprobs = job.logprobs if job.echo else None
            sampling = with_changes(
                job.sampling, max_tokens=budget, prompt_logprobs=echo_logprobs, **tool_fields
            )
            for i in range(job.n):
                request = self._engine_request(job, p * job.n + i, ids, sampling, i)
                parser = answer_parser(job, self._tokenizer, text)
                self._choices.append(Choice(request=request, prompt_text=text, parser=parser))
            reserve += len(ids) + job.n * budget
        return reserve

    def _engine_request(
        self, job: Job, index: int, ids: list[int], sampling: SamplingParams, i: int
    ) -> EngineRequest:
        """Choice `index` of the job (the `i`-th of its prompt, which seeds it apart from the others)."""
        return EngineRequest(
            request_id=f"{job.request_id}-{index}",
            prompt_token_ids=ids,
            sampling=with_changes(sampling, seed=choice_seed(sampling.seed, i)),
            tenant=self._tenant.name,
            model=self._member.name,
            priority=job.priority,
            lane=job.lane,
            arrival_time=job.arrival,
            cache_namespace=self._tenant.cache_namespace,
            tenant_weight=self._tenant.weight,
            cache_share=self._tenant.cache_share,
            adapter=self._adapter(job),
        )

    def _adapter(self, job: Job) -> str | None:
        """The engine's name of the job's LoRA adapter (node/adapters.py registered it there)."""
        return self._tenant.adapters[job.adapter].engine_name(self._tenant.name) if job.adapter else None

    async def run(self, job: Job, outcome: Outcome) -> AsyncGenerator[ChoiceDelta, None]:
        outcome.version = self.version
        first = True
        try:
            async with contextlib.aclosing(engine_outputs(self._engine, self._choices)) as outputs:
                async for index, item in outputs:
                    if first and item.new_token_ids:
                        first = False
                        await hold_first_token(job.arrival, self._limits.ttft_bucket_ms)
                    deltas = self._deltas(job, index, item, outcome)
                    outcome.usage = total_usage(self._choices, job.n)  # read by the usage checkpoints
                    for delta in deltas:
                        yield delta
        finally:
            for choice in self._choices:
                if not choice.finished:
                    self._engine.abort(choice.request.request_id)
            # Billed even when cut short: what the engine did compute for each choice so far.
            outcome.usage = total_usage(self._choices, job.n)

    def _deltas(self, job: Job, index: int, out: RequestOutput, outcome: Outcome) -> list[ChoiceDelta]:
        choice = self._choices[index]
        choice.usage = out.usage
        if choice.finished:  # ended here (a repeated tool call): what the engine made since is billed only
            return []
        deltas: list[ChoiceDelta] = []
        if job.echo and not choice.echoed and echo_ready(job, out):
            choice.echoed = True
            deltas.append(echo_delta(job, index, choice, out, self._pieces))
        now = time.monotonic()
        if out.new_token_ids:
            observe_tokens(choice, out.new_token_ids, now, job.arrival, outcome)
        logprobs = self._pieces.entries(out.logprobs) if job.logprobs is not None else None
        delta = parse_answer(choice, index, out.text_delta, out.finished)
        repeated = choice.parser is not None and choice.parser.repeated
        if repeated and not out.finished:
            self._engine.abort(choice.request.request_id)  # its final output arrives and is passed over
        finish = (
            finish_choice(choice, index, out, outcome, now - job.arrival)
            if out.finished or repeated
            else None
        )
        delta.logprobs, delta.finish_reason = logprobs, finish
        if choice.num_calls and (finish == "stop" or repeated):
            delta.finish_reason = "tool_calls"
        if delta.text or delta.reasoning or delta.tool_calls or logprobs or finish:
            deltas.append(delta)
        return deltas

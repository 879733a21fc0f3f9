"""LLMEngine: add requests, step, abort. One step = schedule → execute → update."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from edgeinfer.engine.attention import KVCacheStorage
from edgeinfer.engine.config import EngineConfig
from edgeinfer.engine.errors import EngineInputError
from edgeinfer.engine.kv_cache import KVCacheManager
from edgeinfer.engine.loading import EngineLayout, load_model, plan_layout, resolve_dtype
from edgeinfer.engine.model.loader import open_checkpoint
from edgeinfer.engine.output_processor import OutputProcessor
from edgeinfer.engine.runner.runner import ModelRunner
from edgeinfer.engine.scheduler import Request, Scheduler, SchedulerConfig
from edgeinfer.engine.threads import use_threads
from edgeinfer.engine.tokenizer import Tokenizer
from edgeinfer.types import EngineRequest, FinishReason, RequestOutput, SamplingParams

log = logging.getLogger(__name__)


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_usage: float
    num_free_blocks: int
    num_total_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int


@dataclass
class Completion:
    """A finished request, as offline `generate` returns it."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None
    outputs: list[RequestOutput]


class LLMEngine:
    def __init__(self, config: EngineConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        self.device = torch.device(config.device)
        use_threads(config.threads)
        ckpt = open_checkpoint(config.model)
        self.checkpoint = ckpt
        self.model_config = ckpt.config
        self.tokenizer = Tokenizer.from_checkpoint(ckpt)
        dtype = resolve_dtype(config.dtype, self.device)
        self.model = load_model(ckpt, dtype, self.device, config)
        self.layout: EngineLayout = plan_layout(config, self.model, dtype)
        storage = KVCacheStorage(
            self.model.kv_spec,
            self.layout.num_kv_blocks,
            config.block_size,
            dtype,
            self.device,
            config.kv_cache_dtype,
        )
        kv = KVCacheManager(self.layout.num_kv_blocks, config.block_size, config.enable_prefix_caching)
        sched_cfg = SchedulerConfig(
            config.max_num_seqs,
            config.max_num_batched_tokens,
            self.layout.max_model_len,
            config.batch_window_ms,
            config.scheduling_policy,
        )
        self.scheduler = Scheduler(sched_cfg, kv, clock)
        self.runner = ModelRunner(
            self.model, storage, self.device, vocab_limit=self.tokenizer.vocab_size, compile=config.compile
        )
        self.outputs = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()
        log.info(
            "engine ready: %s, %s, %d KV blocks x %d tokens (%.1f MiB), context %d",
            config.model,
            dtype,
            self.layout.num_kv_blocks,
            config.block_size,
            self.layout.kv_bytes / 2**20,
            self.layout.max_model_len,
        )

    # ---- requests --------------------------------------------------------------------------------
    def validate(self, request: EngineRequest) -> None:
        """Raise EngineInputError if the request can never be served."""
        try:
            request.sampling.validate()
        except ValueError as e:
            raise EngineInputError(str(e)) from None
        vocab = self.model.args.vocab_size
        bad = [t for t in request.prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise EngineInputError(f"prompt token id {bad[0]} is outside the vocabulary (size {vocab})")
        n, ctx = len(request.prompt_token_ids), self.layout.max_model_len
        if n == 0:
            raise EngineInputError("the prompt is empty")
        if n >= ctx:
            raise EngineInputError(
                f"the prompt has {n} tokens; this model's context is {ctx} tokens "
                "including at least one generated token"
            )

    def add_request(self, request: EngineRequest) -> str:
        self.validate(request)
        req = Request.from_engine_request(request, self.tokenizer.eos_token_ids, self.clock())
        try:
            self.scheduler.add_request(req)
        except ValueError as e:
            raise EngineInputError(str(e)) from None
        self.outputs.add(req, request.arrival_time)
        return request.request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        req = self.scheduler.abort(request_id)
        return self.outputs.make_output(req, self.clock()) if req is not None else None

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # ---- one step --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        result = self.runner.execute(sched)
        now = self.clock()
        outputs = []
        for rid, message in result.errors.items():
            self.runner.storage.zero_blocks(self.scheduler.kv.exclusive_blocks(rid))
            req = self.scheduler.finish(rid, FinishReason.ERROR)
            if req is not None:
                log.error("request %s failed: %s", rid, message)
                outputs.append(self.outputs.make_output(req, now, error=message))
        for rid, lps in result.prompt_logprobs.items():
            self.outputs.add_prompt_logprobs(rid, lps)
        for req in self.scheduler.update(sched, result.tokens):
            if self.outputs.on_token(req, result.logprobs.get(req.request_id), now):
                if req.is_finished:
                    req.finish_reason = FinishReason.STOP  # the stop string came with the last token
                else:
                    self.scheduler.finish(req.request_id, FinishReason.STOP)
            outputs.append(self.outputs.make_output(req, now))
        return outputs

    def next_wakeup(self) -> float | None:
        """When a step can make progress: now if anything runs, else when the admission window closes."""
        if self.scheduler.running:
            return self.clock()
        return self.scheduler.next_admission_time()

    # ---- offline ---------------------------------------------------------------------------------
    def generate(
        self,
        prompts: Sequence[str | list[int]],
        sampling: SamplingParams | Sequence[SamplingParams],
    ) -> list[Completion]:
        """Run prompts to completion together (continuous batching), results in prompt order."""
        params = [sampling] * len(prompts) if isinstance(sampling, SamplingParams) else list(sampling)
        order = []
        for prompt, sp in zip(prompts, params, strict=True):
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            rid = f"gen-{next(self._ids)}"
            self.add_request(EngineRequest(rid, ids, sp, arrival_time=self.clock()))
            order.append((rid, ids))
        collected: dict[str, list[RequestOutput]] = {rid: [] for rid, _ in order}
        while self.has_unfinished_requests():
            wake = self.next_wakeup()
            if wake is not None and wake > self.clock():
                time.sleep(wake - self.clock())
            for out in self.step():
                collected[out.request_id].append(out)
        return [_completion(rid, ids, collected[rid]) for rid, ids in order]

    # ---- introspection ---------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        kv = self.scheduler.kv
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_usage=kv.pool.usage(),
            num_free_blocks=kv.pool.num_free,
            num_total_blocks=kv.pool.num_blocks,
            prefix_cache_queries=kv.prefix_queries,
            prefix_cache_hits=kv.prefix_hits,
            num_preemptions=self.scheduler.num_preemptions,
        )

    def memory_bytes(self) -> int:
        return self.layout.weight_bytes + self.layout.kv_bytes

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()


def _completion(rid: str, prompt_ids: list[int], outs: list[RequestOutput]) -> Completion:
    return Completion(
        request_id=rid,
        prompt_token_ids=prompt_ids,
        token_ids=[t for o in outs for t in o.new_token_ids],
        text="".join(o.text_delta for o in outs),
        finish_reason=outs[-1].finish_reason if outs else None,
        outputs=outs,
    )

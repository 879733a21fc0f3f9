"""LLMEngine: add requests, step, abort. One step = schedule → execute → update."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from edgeinfer.engine.attention.storage import KVCacheStorage
from edgeinfer.engine.cache_dir import cache_root
from edgeinfer.engine.config import EngineConfig
from edgeinfer.engine.draft_loading import build_draft_runner, load_draft_model
from edgeinfer.engine.errors import EngineInputError
from edgeinfer.engine.kv_cache import KVCacheManager
from edgeinfer.engine.kv_cache.hashing import PUBLIC_NAMESPACE, adapter_namespace
from edgeinfer.engine.loading import EngineLayout, load_model, plan_layout, resolve_dtype, uses_cpu_gemv
from edgeinfer.engine.lora import AdapterError, AdapterRegistry, UnknownAdapterError
from edgeinfer.engine.model.compile import use_persistent_compile_cache
from edgeinfer.engine.model.loader import open_checkpoint
from edgeinfer.engine.output_processor import OutputProcessor
from edgeinfer.engine.public_prefix import public_token_ids
from edgeinfer.engine.runner.grammar import GrammarRuntime, LazyGuidanceTokenizer
from edgeinfer.engine.runner.interrupt import StepInterrupted
from edgeinfer.engine.runner.runner import ModelRunner, RunnerOutput
from edgeinfer.engine.runtime import runtime
from edgeinfer.engine.scheduler import Request, Scheduler, SchedulerConfig, SchedulerOutput, SchedulingPolicy
from edgeinfer.engine.scheduler.drafting import MODEL_DRAFTERS
from edgeinfer.engine.tokenizer import Tokenizer
from edgeinfer.types import EngineRequest, FinishReason, RequestOutput, SamplingParams, TokenLogprob
from edgeinfer.types.validation import check_prompt

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
    # Per tenant: cached unreferenced blocks held now (what its cache share bounds), and blocks of its
    # evicted so far.
    cached_blocks_by_tenant: dict[str, int] = field(default_factory=dict)
    evicted_blocks_by_tenant: dict[str, int] = field(default_factory=dict)
    # Speculative decoding, per draft source (scheduler/drafting.py): tokens drafted, and of those accepted.
    spec_drafted_by_source: dict[str, int] = field(default_factory=dict)
    spec_accepted_by_source: dict[str, int] = field(default_factory=dict)
    # Of num_running / num_waiting: batch-lane requests (queued work), which interactive ones go before.
    num_running_batch: int = 0
    num_waiting_batch: int = 0


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
        self.runtime = runtime()
        ckpt = open_checkpoint(config.model)
        self.checkpoint = ckpt
        self.model_config = ckpt.config
        dtype = resolve_dtype(config.dtype, self.device)
        with ThreadPoolExecutor(1, thread_name_prefix="edgeinfer-tokenizer") as aside:
            # SentencePiece reads its model without the GIL, so it overlaps the weights' load;
            # a tokenizer that cannot be read is reported once they have
            tokenizer = aside.submit(Tokenizer.from_checkpoint, ckpt)
            self.model = load_model(ckpt, dtype, self.device, config, tokenizer.result)
            self.tokenizer = tokenizer.result()
        draft = None
        if config.speculative_method in MODEL_DRAFTERS:
            draft = load_draft_model(config, self.tokenizer, dtype, self.device)
        self.layout: EngineLayout = plan_layout(config, self.model, dtype, draft)
        storage = KVCacheStorage(
            self.model.kv_spec,
            self.layout.num_kv_blocks,
            config.block_size,
            dtype,
            self.device,
            config.kv_cache_dtype,
            self.layout.kv_groups,
        )
        kv = KVCacheManager(
            self.layout.num_kv_blocks,
            config.block_size,
            config.enable_prefix_caching,
            config.cache_tenant_shares,
            self.layout.kv_groups.windows,
        )
        sched_cfg = SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.layout.max_model_len,
            batch_window_ms=config.batch_window_ms,
            policy=SchedulingPolicy(config.scheduling_policy),
            fair_share=config.fair_share,
            max_step_ms=config.max_step_ms,
            shared_step_ms=config.shared_step_ms,
            batch_step_ms=config.batch_step_ms,
            # compiled graphs run a step's layers in one piece: the runner cannot stop them between layers
            interruptible_steps=not config.compile,
            speculative=config.spec_config(),
        )
        self.scheduler = Scheduler(sched_cfg, kv, clock)
        if config.compile:
            use_persistent_compile_cache(
                Path(config.cache_dir).expanduser() if config.cache_dir else cache_root()
            )
        guidance = LazyGuidanceTokenizer(
            self.tokenizer.hf, self.tokenizer.vocab_size, self.tokenizer.eos_token_ids
        )
        self.runner = ModelRunner(
            self.model,
            storage,
            self.device,
            backend=config.attention_backend,
            vocab_limit=self.tokenizer.vocab_size,
            compile=config.compile,
            guidance_tokenizer=guidance,
            decode_ops=self.runtime.kernels if uses_cpu_gemv(self.model) else None,
        )
        if draft is not None:
            limits = self.runtime.kernels
            self.runner.draft = build_draft_runner(
                config, self.layout, draft, self.tokenizer, self.device, limits
            )
        # LoRA adapters by name (engine/lora/): no hooks on the model until the first one is loaded
        self.adapters = AdapterRegistry(self.model, dtype)
        self.runner.lora = self.adapters
        self.num_interrupted_steps = 0  # batch-only steps dropped for interactive work
        self.outputs = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()
        if self.runner.compiled is not None:
            self._warm_up()
        for ids in public_token_ids(self.tokenizer, config.public_prefixes, config.public_system_prompts):
            self.add_public_prefix(ids)
        log.info(
            "engine ready: %s, %s, %d KV blocks x %d tokens x %d layers, %d KV groups (%.1f MiB), context %d",
            config.model,
            dtype,
            self.layout.num_kv_blocks,
            config.block_size,
            self.layout.kv_groups.slots,
            len(self.layout.kv_groups.groups),
            self.layout.kv_bytes / 2**20,
            self.layout.max_model_len,
        )

    def _warm_up(self) -> None:
        """Compile the one-sequence decode graph now, so that the first request does not wait for it: a
        short greedy generation runs one prefill and two compiled decode steps (the second checks that
        the graph holds for another context length). Its blocks stay in the prefix cache as free blocks."""
        start = time.perf_counter()
        prompt = [self.tokenizer.bos_token_id or 0] * 5
        self.generate([prompt], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
        log.info("compiled the decode step in %.1f s", time.perf_counter() - start)

    def add_public_prefix(self, token_ids: list[int]) -> int:
        """Compute `token_ids` once in the public namespace and pin its whole blocks: every tenant's
        request that starts with them hits them. Call before serving (it steps the engine itself).
        Returns the number of pinned blocks."""
        rid = f"public-{next(self._ids)}"
        sampling = SamplingParams(max_tokens=1, temperature=0.0)
        self.add_request(EngineRequest(rid, list(token_ids), sampling, cache_namespace=PUBLIC_NAMESPACE))
        while self.has_unfinished_requests():
            self.step()
        kv = self.scheduler.kv
        # One token more, so that lookup (which leaves the last token to compute) covers every whole block.
        return kv.pin(kv.lookup(PUBLIC_NAMESPACE, [*token_ids, 0]))

    # ---- requests --------------------------------------------------------------------------------
    def validate(self, request: EngineRequest) -> None:
        """Raise EngineInputError if the request can never be served."""
        try:
            request.sampling.validate()
            check_prompt(request.prompt_token_ids, self.model.args.vocab_size, self.layout.max_model_len)
        except ValueError as e:
            raise EngineInputError(str(e)) from None
        if request.adapter is not None and not self.adapters.has(request.adapter):
            raise UnknownAdapterError(f"adapter {request.adapter!r} does not exist")

    def add_request(self, request: EngineRequest) -> str:
        self.validate(request)
        if request.adapter is not None:  # UnknownAdapterError (an EngineInputError) for a name not loaded
            fingerprint = self.adapters.acquire(request.request_id, request.adapter)
            namespace = adapter_namespace(request.cache_namespace, fingerprint)
            request = dataclasses.replace(request, cache_namespace=namespace)
        try:
            return self._add(request)
        except Exception:
            self.adapters.release([request.request_id])
            raise

    def _add(self, request: EngineRequest) -> str:
        req = Request.from_engine_request(request, self.tokenizer.eos_token_ids, self.clock())
        matcher = self._matcher(request.sampling.grammar)
        # Output state first: a request the scheduler holds must always have one, or every step would fail.
        self.outputs.add(req, request.arrival_time)
        try:
            self.scheduler.add_request(req)
        except ValueError as e:
            self.outputs.drop(req.request_id)
            raise EngineInputError(str(e)) from None
        if matcher is not None:
            self.grammar.add(request.request_id, matcher)
        return request.request_id

    # ---- adapters --------------------------------------------------------------------------------
    def load_adapter(self, name: str, path: str | Path, pin: bool = False) -> None:
        """Register the PEFT LoRA adapter in directory `path` as `name` (AdapterError, a ValueError with a
        one-line message, if it cannot be served on this model); `pin` keeps it resident for good."""
        if self.config.quantization and self.config.calibrate_quantization:
            # smoothing divides each layer's input by a scale folded into the norm before it, so the
            # modules see another input than the adapter was trained on
            raise AdapterError(
                "adapters need a base quantized without calibration (--no-calibrate-quantization)"
            )
        self.adapters.register(name, path, pin)

    def unload_adapter(self, name: str) -> None:
        self.adapters.unregister(name)

    @property
    def grammar(self) -> GrammarRuntime:
        assert self.runner.grammar is not None
        return self.runner.grammar

    def _matcher(self, grammar: str | None) -> Any:
        if grammar is None:
            return None
        try:
            return self.grammar.new_matcher(grammar)
        except ValueError as e:
            raise EngineInputError(str(e)) from None

    def abort(self, request_id: str) -> RequestOutput | None:
        req = self.scheduler.abort(request_id)
        self.adapters.release([request_id])
        return self.outputs.make_output(req, self.clock()) if req is not None else None

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # ---- one step --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One step for every scheduled request. What one request brings (its sampling parameters, NaN
        logits, an exception while decoding its text) fails that request alone; the others' tokens are
        those of a step without it."""
        sched = self.scheduler.schedule()
        self.adapters.release(sched.finished)  # any finish the step's outputs below did not report
        # Blocks last written for another tenant: scrubbed before this step writes them (block_pool.py).
        self.runner.storage.zero_blocks(self.scheduler.kv.pool.take_dirty())
        started = time.perf_counter()  # the machine's own time, whatever clock the engine is given
        try:
            result = self._execute(sched)
        except StepInterrupted:
            self.scheduler.abandon(sched)
            self.num_interrupted_steps += 1
            return []
        if sched.chunks:
            decode_rows = sum(c.num_tokens for c in sched.chunks if c.is_decode)
            self.scheduler.observe_step(sched.num_tokens, time.perf_counter() - started, decode_rows)
        # Fed once, after the step and any isolation re-runs: a re-run never advances a matcher twice.
        result.feed_grammar(self.runner.grammar)
        now = self.clock()
        outputs = []
        for rid, message in result.errors.items():
            self.runner.storage.zero_blocks(self.scheduler.kv.exclusive_blocks(rid))
            req = self.scheduler.finish(rid, FinishReason.ERROR)
            if req is not None:
                log.error("request %s failed: %s", rid, message)
                outputs.append(self.outputs.fail(req, message, now))
        for rid, lps in result.prompt_logprobs.items():
            self.outputs.add_prompt_logprobs(rid, lps)
        had = {c.request_id: len(c.output_token_ids) for c in sched.chunks}
        for req in self.scheduler.update(sched, result.tokens):
            grammar_done = req.request_id in result.grammar_done
            n = len(req.output_token_ids) - had[req.request_id]
            lps = result.logprobs.get(req.request_id, [])
            outputs.append(self._token_output(req, n, lps, grammar_done, now))
        # finished requests no longer hold their adapters resident (nor keep them from being unloaded)
        self.adapters.release([o.request_id for o in outputs if o.finished])
        return outputs

    def _execute(self, sched: SchedulerOutput) -> RunnerOutput:
        """Run the step; if it raises, find the requests that make it fail by running each one alone,
        then redo the step without them (they fail with an error output). StepInterrupted: interactive
        work stopped a batch-only step (runner/interrupt.py)."""
        self.runner.interrupt.armed = sched.interruptible
        try:
            return self.runner.execute(sched)
        except StepInterrupted:
            raise
        except Exception:
            log.exception("a step of %d requests failed; isolating the cause", len(sched.chunks))
        finally:
            self.runner.interrupt.armed = False  # the isolating runs below go to the end
        errors = {}
        for chunk in sched.chunks:
            try:
                self.runner.execute(SchedulerOutput(chunks=[chunk]))
            except Exception:
                log.exception("request %s fails its step", chunk.request_id)
                errors[chunk.request_id] = "internal error while computing this request's next token"
        healthy = SchedulerOutput(chunks=[c for c in sched.chunks if c.request_id not in errors])
        result = self.runner.execute(healthy)
        result.errors.update(errors)
        return result

    def _token_output(
        self, req: Request, n: int, logprobs: list[TokenLogprob], grammar_done: bool, now: float
    ) -> RequestOutput:
        """Decode the request's `n` new tokens (stop strings included); an exception there fails it alone.
        A stop string ending at one of them drops the ones after it: without speculation the request
        would have finished there."""
        try:
            kept = self.outputs.on_tokens(req, n, logprobs, now)
            if kept is not None:
                del req.output_token_ids[len(req.output_token_ids) - n + kept :]
                if req.is_finished:
                    req.finish_reason = FinishReason.STOP  # it ended at or after the stop string's token
                else:
                    self.scheduler.finish(req.request_id, FinishReason.STOP)
            elif grammar_done and not req.is_finished:
                self.scheduler.finish(req.request_id, FinishReason.STOP)  # nothing may follow but EOS
            return self.outputs.make_output(req, now)
        except Exception:
            log.exception("decoding the output of request %s failed", req.request_id)
            self.scheduler.finish(req.request_id, FinishReason.ERROR)
            return self.outputs.fail(req, "internal error while decoding this request's output", now)

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
        adapters: str | Sequence[str | None] | None = None,
    ) -> list[Completion]:
        """Run prompts to completion together (continuous batching), results in prompt order; `adapters`:
        one adapter name for all, or one (or None, the base) per prompt."""
        params = [sampling] * len(prompts) if isinstance(sampling, SamplingParams) else list(sampling)
        names = [adapters] * len(prompts) if adapters is None or isinstance(adapters, str) else list(adapters)
        order = []
        for prompt, sp, adapter in zip(prompts, params, names, strict=True):
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            rid = f"gen-{next(self._ids)}"
            self.add_request(EngineRequest(rid, ids, sp, arrival_time=self.clock(), adapter=adapter))
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
            cached_blocks_by_tenant=kv.pool.held_by_owner(),
            evicted_blocks_by_tenant=dict(kv.pool.evicted_by_owner),
            spec_drafted_by_source=dict(self.scheduler.spec_drafted),
            spec_accepted_by_source=dict(self.scheduler.spec_accepted),
            num_running_batch=self.scheduler.num_batch_running(),
            num_waiting_batch=self.scheduler.waiting.num_batch,
        )

    def memory_bytes(self) -> int:
        return self.layout.weight_bytes + self.layout.kv_bytes + self.adapters.resident_bytes()

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

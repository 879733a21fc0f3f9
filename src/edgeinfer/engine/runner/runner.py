"""Runs one scheduled step: inputs → model → logits → tokens."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from edgeinfer.engine.attention.backend import get_attention_backend
from edgeinfer.engine.attention.storage import KVCacheStorage
from edgeinfer.engine.attention.torch_backend import TorchPagedBackend
from edgeinfer.engine.kernels.limits import KernelLimits
from edgeinfer.engine.model.compile import DecodeCompiledForward
from edgeinfer.engine.model.decode_ops import use_decode_ops
from edgeinfer.engine.model.fused_decode import FusedDecode, fused_decode
from edgeinfer.engine.runner.grammar import GrammarRuntime, LazyGuidanceTokenizer
from edgeinfer.engine.runner.inputs import StepInputs, build_inputs
from edgeinfer.engine.runner.interrupt import StepInterrupt, StepInterrupted
from edgeinfer.engine.runner.sampler import Sampler, top_logprobs
from edgeinfer.engine.runner.speculative import per_request
from edgeinfer.engine.scheduler import SchedulerOutput
from edgeinfer.types import TokenLogprob

if TYPE_CHECKING:
    from edgeinfer.engine.lora import AdapterRegistry
    from edgeinfer.engine.runner.draft import DraftRunner

log = logging.getLogger(__name__)


@dataclass
class RunnerOutput:
    """Per request: the tokens it emits this step (one, or more where drafts were accepted) and their
    logprobs where asked."""

    tokens: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    grammar_done: set[str] = field(default_factory=set)  # requests whose grammar completed with this token

    def feed_grammar(self, grammar: GrammarRuntime | None) -> None:
        """Advance the constrained requests' matchers by this step's tokens, once per step (never inside
        `execute`, which may be run again for the same step); a rejected token fails its request."""
        if grammar is None or not grammar.active:
            return
        self.grammar_done, errors = grammar.consume(self.tokens)  # cuts tokens after a completed grammar
        for rid in errors:
            self.tokens.pop(rid, None)
        for rid, lps in self.logprobs.items():
            del lps[len(self.tokens.get(rid, ())) :]
        self.errors.update(errors)


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        storage: KVCacheStorage,
        device: torch.device,
        backend: str = "torch",
        vocab_limit: int | None = None,
        compile: bool = False,
        guidance_tokenizer: LazyGuidanceTokenizer | None = None,
        decode_ops: KernelLimits | None = None,
    ) -> None:
        self.model = model
        self.storage = storage
        self.device = device
        self.backend = get_attention_backend(backend, storage)
        # every all-decode step through one C++ call where every layer runs on our kernels anyway
        self.fused: FusedDecode | None = None
        if decode_ops is not None:  # the model runs on our CPU kernels, so they are built and loaded
            use_decode_ops(model, decode_ops)
            self.backend.decode_ops = True
            # the fused step attends as the torch backend's decode ops do: never in place of another
            if isinstance(self.backend, TorchPagedBackend):
                self.fused = fused_decode(model, storage, decode_ops)
        # A compiled one-sequence graph only where the fused step does not take the model: where it does, it
        # is the faster of the two (in int4 and bf16 alike) and it takes batched decode steps too.
        self.compiled = DecodeCompiledForward(model) if compile and self.fused is None else None
        if compile and self.fused is not None:
            log.info("compile: the fused decode step takes all decode steps of this model, none compiled")
        self.sampler = Sampler(vocab_limit)
        self.grammar = GrammarRuntime(guidance_tokenizer) if guidance_tokenizer is not None else None
        self.num_steps = 0
        self._logits: torch.Tensor | None = None
        self.lora: AdapterRegistry | None = None  # set by the engine
        self.draft: DraftRunner | None = None  # set by the engine for a draft model's speculation
        self.interrupt = StepInterrupt()  # armed by the engine for a batch-only step
        self.interrupt.watch(model.model.layers)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        self.sampler.forget(sched.finished)
        if self.draft is not None:
            self.draft.forget(sched.finished)
        if self.grammar is not None:
            self.grammar.forget(sched.finished)
        if sched.is_empty:
            return RunnerOutput()
        self.num_steps += 1
        # a draft model's drafts are proposed now, in place of the places the scheduler reserved
        chunks = self.draft.fill(sched.chunks, sched.few_running) if self.draft is not None else sched.chunks
        inp = build_inputs(chunks, self.storage.block_size, self.device)
        pending_masks = self.grammar.start_masks(inp.groups) if self.grammar is not None else None
        hidden = self.forward(inp)
        out = RunnerOutput()
        if inp.sample_rows:
            rows = hidden[inp.sample_rows]
            logits = self.model.compute_logits(rows, self._logits_buffer(len(inp.sample_rows)))
            masks = pending_masks.result() if pending_masks is not None else None
            res = self.sampler.sample(logits, inp.sample_chunks, masks)
            out.tokens, out.logprobs = per_request(inp.groups, res.rows, res.row_logprobs, set(res.errors))
            out.errors = res.errors
        if inp.prompt_logprob_rows:
            out.prompt_logprobs = self._prompt_logprobs(hidden, inp)
        return out

    def forward(self, inp: StepInputs) -> torch.Tensor:
        """The step's hidden states (final norm applied), one row per input token."""
        self.backend.begin(inp.attn)
        all_decode = inp.attn.num_decodes == inp.attn.num_seqs
        lora = self.lora.begin_step(inp.chunks) if self.lora is not None else None
        if self.fused is not None and all_decode:  # adds the adapters' deltas itself
            fused = self.fused(inp.input_ids, inp.positions, inp.attn, self.interrupt.stop_flag(), lora)
            if fused is None:
                raise StepInterrupted
            return fused
        if self.compiled is not None and lora is None:
            # adapter deltas ride on the modules' forward hooks (engine/lora/apply.py), which a compiled
            # graph never calls: a step with adapter rows runs eagerly, base rows included
            single_decode = all_decode and inp.attn.num_seqs == 1
            return self.compiled(inp.input_ids, inp.positions, self.backend, single_decode)
        return self.model(inp.input_ids, inp.positions, self.backend)

    def _logits_buffer(self, rows: int) -> torch.Tensor:
        """fp32 `[rows, vocab]`, reused across steps (the sampler keeps nothing past a step). A fresh
        block of a batch's logits lies above glibc's largest mmap threshold, so it would be mapped and
        page-faulted anew every step, which costs many times what filling reused memory does."""
        if self._logits is None or self._logits.shape[0] < rows:
            vocab = self.model.args.vocab_size
            self._logits = torch.empty(rows, vocab, dtype=torch.float32, device=self.device)
        return self._logits[:rows]

    def _prompt_logprobs(self, hidden: torch.Tensor, inp: StepInputs) -> dict[str, list[TokenLogprob]]:
        result = {}
        for c in inp.chunks:
            rows = inp.prompt_logprob_rows.get(c.request_id)
            if rows is None:
                continue
            if not rows:
                result[c.request_id] = []
                continue
            lp = torch.log_softmax(self.model.compute_logits(hidden[rows]), dim=-1)
            targets = torch.tensor(
                c.prompt_token_ids[c.start + 1 : c.start + 1 + len(rows)], device=lp.device
            )
            result[c.request_id] = top_logprobs(lp, targets, c.sampling.prompt_logprobs)
        return result

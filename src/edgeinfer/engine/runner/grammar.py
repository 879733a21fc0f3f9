"""Grammar-constrained sampling with llguidance: one matcher per constrained request, a token bitmask per
sampled row each step, tokens fed back to the matchers after sampling.

A request verifying draft tokens (runner/speculative.py) has one row per draft besides its own: row j's mask
is the grammar's state after the first j drafts (llguidance advances a matcher through the drafts and
rolls it back); a draft the grammar forbids is masked out of the row that checks it, so it is rejected
there, and the rows after it are never emitted.

The masks of step N+1 only depend on the tokens of step N, so they are computed on a worker thread while
the model runs step N+1's forward (llguidance releases the GIL while it computes; the forward spends its
time in torch ops that release it too). A matcher that errs fails its own request only.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import llguidance
import numpy as np
import torch

from edgeinfer.engine.direct_tokenizer import serialized_tokenizer
from edgeinfer.engine.runner.inputs import SampleGroup

log = logging.getLogger(__name__)


class LazyGuidanceTokenizer:
    """llguidance's view of the vocabulary, built by the first constrained request (seconds for a large
    vocabulary such as Gemma's, then kept for the engine's life).

    Not at engine start: the build holds the interpreter for its whole duration (llguidance parses the
    tokenizer in Rust without releasing the GIL), so on a background thread it still delayed a cached
    start by as long, and after start it would pause every running stream; most engines never see a
    constrained request."""

    def __init__(self, hf_tokenizer: object, vocab_size: int, eos_ids: Iterable[int]) -> None:
        self.vocab_size = vocab_size
        self._eos = sorted(eos_ids)
        self._hf = hf_tokenizer
        self._result: llguidance.LLTokenizer | ValueError | None = None
        self._lock = threading.Lock()

    def get(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._result is None:
                self._result = self._build()
        if isinstance(self._result, ValueError):
            raise self._result
        return self._result

    def _build(self) -> llguidance.LLTokenizer | ValueError:
        started = time.perf_counter()
        try:
            # from the serialized form, as llguidance.hf does (that module imports transformers)
            built = llguidance.LLTokenizer(
                serialized_tokenizer(self._hf), n_vocab=self.vocab_size, eos_token=self._eos
            )
        except Exception as exc:  # a tokenizer llguidance cannot read: constrained requests fail, others run
            log.warning("grammar-constrained decoding unavailable: %s", exc)
            return ValueError(f"grammar-constrained decoding is unavailable for this tokenizer: {exc}")
        log.info("built llguidance's view of the vocabulary in %.2f s", time.perf_counter() - started)
        return built


@dataclass
class StepMasks:
    """Bitmasks for one step's sampled rows: `bits[k]` belongs to sample row `rows[k]`."""

    rows: list[int] = field(default_factory=list)
    bits: np.ndarray | None = None
    errors: dict[str, str] = field(default_factory=dict)


class GrammarRuntime:
    def __init__(self, tokenizer: LazyGuidanceTokenizer) -> None:
        self._tokenizer = tokenizer
        self._matchers: dict[str, llguidance.LLMatcher] = {}
        self._executor = llguidance.LLExecutor(num_threads=1)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="edgeinfer-masks")

    @property
    def active(self) -> bool:
        return bool(self._matchers)

    def new_matcher(self, grammar: str) -> llguidance.LLMatcher:
        """A matcher for `grammar`; ValueError naming the problem if it does not compile."""
        matcher = llguidance.LLMatcher(self._tokenizer.get(), grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"the grammar does not compile: {matcher.get_error()}")
        return matcher

    def add(self, request_id: str, matcher: llguidance.LLMatcher) -> None:
        self._matchers[request_id] = matcher

    def forget(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self._matchers.pop(rid, None)

    def start_masks(self, groups: list[SampleGroup]) -> Future[StepMasks] | None:
        """Begin computing the masks of the constrained rows among the sample rows of `groups`."""
        rows = [(g, m) for g in groups if (m := self._matchers.get(g.chunk.request_id))]
        if not rows:
            return None
        return self._pool.submit(self._masks, rows)

    def _masks(self, rows: list[tuple[SampleGroup, llguidance.LLMatcher]]) -> StepMasks:
        words = (self._tokenizer.vocab_size + 31) // 32
        out = StepMasks()
        live, drafted = [], []
        for g, matcher in rows:
            if matcher.is_error():
                out.errors[g.chunk.request_id] = f"grammar matcher failed: {matcher.get_error()}"
                continue
            if g.chunk.draft_token_ids:
                drafted.append((matcher, len(out.rows), g.chunk.draft_token_ids))
            else:
                live.append((matcher, len(out.rows)))
            out.rows.extend(range(g.first, g.first + g.size))
        # rows past a draft the grammar refuses stay unmasked: they are never emitted
        out.bits = np.full((len(out.rows), words), -1, dtype=np.int32)
        ptr, size = out.bits.ctypes.data, words * 4
        if live:
            self._executor.unsafe_compute_mask_ptr(live, ptr, size, len(out.rows))
        if drafted:
            self._executor.unsafe_compute_mask_ptr_with_draft_token(drafted, ptr, size, len(out.rows))
        return out

    def consume(self, tokens: dict[str, list[int]]) -> tuple[set[str], dict[str, str]]:
        """Feed each request's tokens to its matcher, in order: (requests whose grammar is now complete,
        failures). Tokens after the one that completes a grammar are cut from `tokens`: without
        speculation the request would have finished there."""
        done, errors = set(), {}
        for rid, toks in tokens.items():
            matcher = self._matchers.get(rid)
            if matcher is None:
                continue
            for i, token in enumerate(toks):
                if not matcher.consume_token(token):
                    errors[rid] = f"grammar matcher rejected token {token}: {matcher.get_error()}"
                    break
                if matcher.is_stopped():
                    done.add(rid)
                    del toks[i + 1 :]
                    break
        return done, errors


def apply_masks(logits: torch.Tensor, masks: StepMasks) -> None:
    """Set the logits of tokens the grammar forbids to -inf, in place (rows `masks.rows`).

    The bitmask holds bit t % 32 of word t // 32 for token t; read as little-endian bytes that is bit
    t % 8 of byte t // 8, so unpacking the inverted bytes (`bitorder="little"`) gives one 0/1 byte per
    token, 1 where forbidden, which torch reads as bools without a copy. Each row is filled in place:
    gathering the rows into a new tensor and scattering them back would cost about twice as much.
    """
    if not masks.rows or masks.bits is None:
        return
    vocab = logits.shape[-1]
    forbidden = np.unpackbits(~masks.bits.view(np.uint8), axis=-1, bitorder="little")
    width = min(vocab, forbidden.shape[-1])
    forbid = torch.from_numpy(forbidden[:, :width]).view(torch.bool).to(logits.device)
    for k, row in enumerate(masks.rows):
        logits[row, :width].masked_fill_(forbid[k], float("-inf"))
    if width < vocab:  # ids past the tokenizer's vocabulary are never allowed
        logits[masks.rows, width:] = float("-inf")

"""Grammar-constrained sampling with llguidance: one matcher per constrained request, a token bitmask per
sampled row each step, tokens fed back to the matchers after sampling.

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
from edgeinfer.engine.scheduler import ScheduledChunk

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

    def start_masks(self, chunks: list[ScheduledChunk]) -> Future[StepMasks] | None:
        """Begin computing the masks of the constrained rows among `chunks` (sample order)."""
        rows = [(i, c.request_id, m) for i, c in enumerate(chunks) if (m := self._matchers.get(c.request_id))]
        if not rows:
            return None
        return self._pool.submit(self._masks, rows)

    def _masks(self, rows: list[tuple[int, str, llguidance.LLMatcher]]) -> StepMasks:
        words = (self._tokenizer.vocab_size + 31) // 32
        out = StepMasks()
        live = []
        for row, rid, matcher in rows:
            if matcher.is_error():
                out.errors[rid] = f"grammar matcher failed: {matcher.get_error()}"
            else:
                live.append((matcher, len(out.rows)))
                out.rows.append(row)
        out.bits = np.full((len(out.rows), words), -1, dtype=np.int32)
        if live:
            self._executor.unsafe_compute_mask_ptr(live, out.bits.ctypes.data, words * 4, len(out.rows))
        return out

    def consume(self, tokens: dict[str, int]) -> tuple[set[str], dict[str, str]]:
        """Feed sampled tokens to their matchers: (requests whose grammar is now complete, failures)."""
        done, errors = set(), {}
        for rid, token in tokens.items():
            matcher = self._matchers.get(rid)
            if matcher is None:
                continue
            if not matcher.consume_token(token):
                errors[rid] = f"grammar matcher rejected token {token}: {matcher.get_error()}"
            elif matcher.is_stopped():
                done.add(rid)
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

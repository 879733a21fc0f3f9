"""`run_eval`: one quantized configuration against the unquantized baseline on the eval text."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from edgeinfer.corpus import NEWS_TEXT, Corpus, load_text
from edgeinfer.engine.config import EngineConfig
from edgeinfer.engine.engine import LLMEngine
from edgeinfer.engine.loading import parse_quantization
from edgeinfer.engine.quant.kv import get_kv_quantizer
from edgeinfer.engine.tokenizer import Tokenizer
from edgeinfer.eval.metrics import greedy_match_length
from edgeinfer.eval.report import EvalReport, ModelSide
from edgeinfer.eval.scoring import Candidate, compare
from edgeinfer.types import SamplingParams

log = logging.getLogger(__name__)

# Held-out news, unrelated to the texts quantization calibrates on (quant/calibrate.py).
DEFAULT_TEXT = NEWS_TEXT


@dataclass(frozen=True)
class EvalSettings:
    """What `edgeinfer eval` measures. `engine`: the tested configuration (the `serve` / `generate` engine
    flags). The baseline is the same engine with `baseline_quantization` weights (None: unquantized), its
    KV cache in the compute dtype and torch's kernels (so int4 against int4 compares W4A8 with W4A16 where
    our CPU kernels run). `stride` None is `window // 2`."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    baseline_quantization: str | None = None
    text: str = DEFAULT_TEXT
    tokens: int = 1024
    window: int = 512
    stride: int | None = None
    prefixes: int = 4
    prefix_tokens: int = 32
    greedy_tokens: int = 32

    def __post_init__(self) -> None:
        checks = {
            "tokens": (self.tokens, 2),
            "window": (self.window, 2),
            "prefixes": (self.prefixes, 0),
            "prefix_tokens": (self.prefix_tokens, 1),
            "greedy_tokens": (self.greedy_tokens, 1),
        }
        for name, (value, low) in checks.items():
            if value < low:
                raise ValueError(f"{name} must be >= {low}, got {value}")
        if not 1 <= self.effective_stride <= self.window:
            raise ValueError(f"stride must be between 1 and the window ({self.window}), got {self.stride}")
        # Fail on a misspelt method or KV dtype before loading any model.
        for q in (self.engine.quantization, self.baseline_quantization):
            if q is not None:
                parse_quantization(q)
        get_kv_quantizer(self.engine.kv_cache_dtype)

    @property
    def effective_stride(self) -> int:
        return self.stride if self.stride is not None else max(1, self.window // 2)

    @property
    def baseline(self) -> EngineConfig:
        q = self.baseline_quantization
        gptq = self.engine.gptq_calibration if (q or "").startswith("int4") else None
        return replace(
            self.engine, quantization=q, gptq_calibration=gptq, kv_cache_dtype="auto", cpu_gemv=False
        )

    @property
    def shares_baseline(self) -> bool:
        """Whether one engine serves both sides: only where the tested side cannot differ (with our CPU
        kernels, the default where the CPU has AVX2, int4 against int4 compares W4A8 with W4A16)."""
        e = self.engine
        return (
            e.quantization == self.baseline_quantization
            and e.kv_cache_dtype == "auto"
            and (e.quantization is None or e.cpu_gemv is False)
        )


def eval_tokens(text: Corpus, tokenizer: Tokenizer, n: int) -> list[int]:
    """The first `n` tokens of the text (no BOS: windows add their own)."""
    ids = tokenizer.encode(text.text, add_special_tokens=False)
    if len(ids) < n:
        raise ValueError(f"the eval text {text.name!r} has {len(ids)} tokens; --tokens {n} asks for more")
    return ids[:n]


def greedy_prompts(text: Corpus, tokenizer: Tokenizer, count: int, length: int) -> list[list[int]]:
    """`count` fixed prompts: the first `length` tokens of documents spread evenly through the text."""
    docs = text.documents
    picks = [docs[i * len(docs) // count] for i in range(count)] if count else []
    bos = [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]
    return [bos + tokenizer.encode(d, add_special_tokens=False)[:length] for d in picks]


def greedy_match_lengths(
    reference: LLMEngine, test: LLMEngine, prompts: Sequence[list[int]], n: int
) -> list[int]:
    """Per prompt: how many greedy tokens the test engine generates before it first differs."""
    if not prompts:
        return []
    sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    ref = reference.generate(list(prompts), sp)
    out = ref if test is reference else test.generate(list(prompts), sp)
    return [greedy_match_length(a.token_ids, b.token_ids) for a, b in zip(ref, out, strict=True)]


def run_eval(settings: EvalSettings) -> EvalReport:
    """Load the baseline and the quantized configuration, score the text under both, compare."""
    start = time.perf_counter()
    text = load_text(settings.text)
    baseline = LLMEngine(settings.baseline)
    test = baseline if settings.shares_baseline else LLMEngine(settings.engine)
    ids = eval_tokens(text, baseline.tokenizer, settings.tokens)
    result = compare(
        Candidate.from_engine("baseline", baseline),
        [Candidate.from_engine("test", test)],
        ids,
        baseline.tokenizer.bos_token_id,
        settings.window,
        settings.effective_stride,
    )
    prompts = greedy_prompts(text, baseline.tokenizer, settings.prefixes, settings.prefix_tokens)
    lengths = greedy_match_lengths(baseline, test, prompts, settings.greedy_tokens)
    return EvalReport(
        settings=settings,
        dtype=str(baseline.layout.dtype).removeprefix("torch."),
        text_name=text.name,
        text_source=text.source,
        baseline=ModelSide.of(baseline, settings.baseline_quantization),
        test=ModelSide.of(test, settings.engine.quantization),
        baseline_perplexity=result.reference_perplexity,
        comparison=result.comparisons()["test"],
        greedy_lengths=lengths,
        seconds=time.perf_counter() - start,
    )

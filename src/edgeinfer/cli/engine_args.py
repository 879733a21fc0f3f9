"""The engine flags, declared once. Every command that builds an engine (`serve`, `generate`, `eval`) adds
them with `add_engine_arguments` and turns what was parsed into an `EngineConfig` with `engine_config`, so
the same flags mean the same engine everywhere; the process-wide one (`--threads`) starts the process's
runtime with `start_runtime_for`, before any model loads. Their defaults are EngineConfig's own; what
each setting does is documented on its field (engine/config.py).

Torch-free: parsing the flags of `serve` or `generate` (or `--help`) loads no torch.
"""

from __future__ import annotations

import argparse

from edgeinfer.engine.attention.registry import ATTENTION_BACKENDS, MLA_MODES
from edgeinfer.engine.config import DEFAULT_MODEL, WEIGHT_FORMS, EngineConfig
from edgeinfer.engine.scheduler.drafting import DRAFTERS
from edgeinfer.engine.scheduler.queue import SchedulingPolicy
from edgeinfer.pool.spec import parse_bytes

DTYPES = ("auto", "float32", "bfloat16", "float16")
SCHEDULING_POLICIES = tuple(p.value for p in SchedulingPolicy)
_DEFAULTS = EngineConfig()
_UNQUANTIZED = ("none", "bf16", "")


def quantization_arg(value: str) -> str | None:
    """`none` (or `bf16`) is unquantized; any other value names a weight method, checked at load."""
    return None if value.lower() in _UNQUANTIZED else value


def _step_ms(text: str) -> float | None:
    """A step-time target: milliseconds > 0, or 0 for none."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of milliseconds: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError("must be >= 0 (0: no time budget)")
    return value or None


def add_model_argument(parser: argparse.ArgumentParser) -> None:
    """`--model` for a command that builds one engine (`serve` registers a pool of named models instead)."""
    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="HF directory, .gguf file, `edgeinfer compress` directory or a known name "
        f"(default: {DEFAULT_MODEL}, obtained and cached on first use)",
    )


def add_engine_arguments(group: argparse._ActionsContainer) -> None:
    """The flags of `EngineConfig` (all but the model), on a parser or one of its argument groups."""
    _add_precision(group)
    _add_kv_and_batching(group)
    _add_execution(group)
    _add_speculative(group)


def engine_config(args: argparse.Namespace, model: str = DEFAULT_MODEL) -> EngineConfig:
    """The `EngineConfig` that the flags of `add_engine_arguments` describe, serving `model`."""
    return EngineConfig(
        model=model,
        device=args.device,
        dtype=args.dtype,
        quantization=args.quantization,
        lm_head_quantization=args.lm_head_quantization,
        weights=args.weights,
        calibrate_quantization=args.calibrate,
        gptq_calibration=args.gptq,
        cpu_gemv=args.cpu_gemv,
        kv_cache_dtype=args.kv_cache_dtype,
        kv_cache_memory_bytes=parse_bytes(args.kv_cache_memory),
        hybrid_kv_cache=args.hybrid_kv_cache,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_step_ms=args.max_step_ms,
        shared_step_ms=args.shared_step_ms,
        batch_step_ms=args.batch_step_ms,
        batch_window_ms=args.batch_window_ms,
        scheduling_policy=args.scheduling_policy,
        enable_prefix_caching=args.prefix_caching,
        cache_tenant_shares=args.tenant_shares,
        fair_share=args.tenant_shares,
        attention_backend=args.attention_backend,
        mla_mode=args.mla_mode,
        compile=args.compile,
        prepared_cache=args.prepared_cache,
        cache_dir=args.cache_dir,
        speculative_method=args.speculative_method,
        num_speculative_tokens=args.num_speculative_tokens,
        ngram_min=args.ngram_min,
        ngram_max=args.ngram_max,
        speculative_max_batch=args.speculative_max_batch,
        draft_model=args.draft_model,
        draft_vocab_size=args.draft_vocab_size,
    )


def start_runtime_for(args: argparse.Namespace) -> None:
    """Start the process's runtime from the flags (engine/runtime.py): once, before any model loads."""
    from edgeinfer.engine.runtime import start_runtime

    start_runtime(args.threads)


def _add_precision(group: argparse._ActionsContainer) -> None:
    group.add_argument("--device", default=_DEFAULTS.device, help="torch device (default: %(default)s)")
    group.add_argument(
        "--dtype", default=_DEFAULTS.dtype, choices=DTYPES, help="compute dtype, auto: bfloat16 (%(default)s)"
    )
    group.add_argument(
        "--quantization",
        type=quantization_arg,
        default=_DEFAULTS.quantization,
        help="weight quantization at load: int8, int4, int4:G (group size G), fp8, or none (default); a "
        "quantized checkpoint loads as stored",
    )
    group.add_argument(
        "--weights",
        default=_DEFAULTS.weights,
        choices=WEIGHT_FORMS,
        help="how bf16 weights stay in memory: bf16, lossless (every bit kept in ~70%% of the bytes, read by "
        "our CPU kernels where they lie; logits identical to bf16's), auto (lossless for a .eiz checkpoint "
        "where the kernels run it, else bf16; default: %(default)s)",
    )
    group.add_argument(
        "--lm-head-quantization",
        default=_DEFAULTS.lm_head_quantization,
        help="lm_head and embeddings under --quantization: auto (int8 for int4 weights, else the same "
        "method), none (float), or a method (default: %(default)s)",
    )
    group.add_argument(
        "--calibrate",
        action=argparse.BooleanOptionalAction,
        default=_DEFAULTS.calibrate_quantization,
        help="with --quantization of a float checkpoint: first scale layer inputs by the activations of a "
        "built-in text (default: yes)",
    )
    group.add_argument(
        "--gptq",
        default=_DEFAULTS.gptq_calibration,
        metavar="TEXT",
        help="int4: round by GPTQ calibrated on TEXT, enwiki (Wikipedia prose in gensim's test data) or a "
        "UTF-8 file; minutes at load (for serving, quantize once with `edgeinfer quantize --gptq`)",
    )
    group.add_argument(
        "--cpu-gemv",
        action=argparse.BooleanOptionalAction,
        default=_DEFAULTS.cpu_gemv,
        help="CPU products through our kernels (int8/int4 with AVX512-VNNI / AVX2, int4 as W4A8; bf16 decode "
        "with AVX512-BF16 / AVX-512 / AVX2) and one-call ops for one-sequence decode steps; built at first "
        "use (docs/quantization.md). Default: where the CPU has the features",
    )


def _add_kv_and_batching(group: argparse._ActionsContainer) -> None:
    group.add_argument(
        "--kv-cache-dtype",
        default=_DEFAULTS.kv_cache_dtype,
        help="KV cache storage: auto (the compute dtype), bf16, int8, fp8_e4m3, fp8_e5m2, int4 "
        "(default: %(default)s)",
    )
    group.add_argument(
        "--kv-cache-memory",
        default=_DEFAULTS.kv_cache_memory_bytes,
        metavar="SIZE",
        help=f"KV cache per model, e.g. 2GiB (default: {_DEFAULTS.kv_cache_memory_bytes // 2**20}MiB)",
    )
    group.add_argument(
        "--hybrid-kv-cache",
        action=argparse.BooleanOptionalAction,
        default=_DEFAULTS.hybrid_kv_cache,
        help="sliding-window layers keep only the KV blocks their window reaches (default: yes)",
    )
    group.add_argument(
        "--max-model-len",
        type=int,
        default=_DEFAULTS.max_model_len,
        help="context length in tokens (default: the model's)",
    )
    group.add_argument(
        "--max-num-seqs", type=int, default=_DEFAULTS.max_num_seqs, help="sequences per step (%(default)s)"
    )
    group.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=_DEFAULTS.max_num_batched_tokens,
        help="tokens per step (%(default)s)",
    )
    group.add_argument(
        "--max-step-ms",
        type=_step_ms,
        default=_DEFAULTS.max_step_ms,
        metavar="MS",
        help="a step takes what fits in MS by the cost of recent steps (at most --max-num-batched-tokens), "
        "so a request arriving mid-prefill waits about one such step; 0: no limit (%(default)s)",
    )
    group.add_argument(
        "--shared-step-ms",
        type=_step_ms,
        default=_DEFAULTS.shared_step_ms,
        metavar="MS",
        help="the same while more than one tenant is present, so a tenant's first token waits for little "
        "of another's prefill; 0: --max-step-ms throughout (%(default)s)",
    )
    group.add_argument(
        "--batch-step-ms",
        type=_step_ms,
        default=_DEFAULTS.batch_step_ms,
        metavar="MS",
        help="while queued (batch-lane) work runs, a step takes what fits in MS, so an interactive request "
        "arriving meanwhile waits about that long; 0: the budgets above (%(default)s)",
    )
    group.add_argument(
        "--batch-window-ms",
        type=float,
        default=_DEFAULTS.batch_window_ms,
        help="admit requests arriving this close together as one batch; 0: at once (%(default)s)",
    )
    group.add_argument(
        "--scheduling-policy",
        default=_DEFAULTS.scheduling_policy,
        choices=SCHEDULING_POLICIES,
        help="fcfs: arrival order; priority: a request's `priority` first (lower first; tenants may set "
        "it within their range), then arrival (%(default)s)",
    )
    group.add_argument(
        "--prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=_DEFAULTS.enable_prefix_caching,
        help="reuse cached KV blocks of equal prompt prefixes within a tenant (default: yes)",
    )
    group.add_argument(
        "--tenant-shares",
        action=argparse.BooleanOptionalAction,
        default=_DEFAULTS.cache_tenant_shares and _DEFAULTS.fair_share,
        help="per-tenant shares of the cached blocks and fair-share prefill; --no-tenant-shares: one global "
        "LRU and arrival order (default: yes)",
    )


def _add_execution(group: argparse._ActionsContainer) -> None:
    group.add_argument(
        "--attention-backend",
        default=_DEFAULTS.attention_backend,
        choices=list(ATTENTION_BACKENDS),
        help="paged-attention backend (default: %(default)s)",
    )
    group.add_argument(
        "--mla-mode",
        default=_DEFAULTS.mla_mode,
        choices=list(MLA_MODES),
        help="how MLA models (DeepSeek-V3, Kimi K2) decode: absorb the up-projection into query and "
        "output, or expand the cached latents (default: %(default)s)",
    )
    group.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=_DEFAULTS.compile,
        help="torch.compile one-sequence decode steps at load, for models the fused decode step does not "
        "take (MoE, MLA, int8/fp8, an int4 KV cache; it is faster where it does): needs a C++ compiler, "
        "minutes the first time, graphs cached under --cache-dir (default: no)",
    )
    group.add_argument(
        "--prepared-cache",
        action=argparse.BooleanOptionalAction,
        default=_DEFAULTS.prepared_cache,
        help="keep each model's prepared (dequantized, quantized) form on disk and map it on the next load "
        "(default: yes)",
    )
    group.add_argument(
        "--cache-dir",
        default=_DEFAULTS.cache_dir,
        metavar="DIR",
        help="prepared models, compiled graphs and kernel builds ($EDGEINFER_CACHE_DIR, else "
        "~/.cache/edgeinfer)",
    )
    group.add_argument(
        "--threads",
        type=int,
        default=None,
        help="threads for the ops, process-wide (default: every core this process may run on)",
    )


def _add_speculative(group: argparse._ActionsContainer) -> None:
    group.add_argument(
        "--speculative-method",
        default=_DEFAULTS.speculative_method,
        choices=list(DRAFTERS),
        help="speculative decoding: drafts a decoding request's next tokens and verifies them in one step "
        "(the same tokens, several per step where the drafts are right). ngram: from its own prompt and "
        "output; self: by the model's own int4 form (for a bf16 or int8 model); draft: by --draft-model; "
        "default: off",
    )
    group.add_argument(
        "--draft-model",
        default=_DEFAULTS.draft_model,
        help="draft: the draft model (a checkpoint directory or file, the served model's vocabulary)",
    )
    group.add_argument(
        "--draft-vocab-size",
        type=int,
        default=_DEFAULTS.draft_vocab_size,
        help="self / draft: the draft head covers this many of the most frequent tokens (%(default)s)",
    )
    group.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=_DEFAULTS.num_speculative_tokens,
        help="draft tokens per request and step (%(default)s)",
    )
    group.add_argument(
        "--ngram-min",
        type=int,
        default=_DEFAULTS.ngram_min,
        help="ngram: shortest match of the context's last tokens that drafts (%(default)s)",
    )
    group.add_argument(
        "--ngram-max",
        type=int,
        default=_DEFAULTS.ngram_max,
        help="ngram: longest match tried first (%(default)s)",
    )
    group.add_argument(
        "--speculative-max-batch",
        type=int,
        default=_DEFAULTS.speculative_max_batch,
        help="no speculation in a step where more requests than this decode (%(default)s)",
    )

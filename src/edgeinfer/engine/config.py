"""Frozen engine configuration. Values measured at start-up live in `EngineLayout`, never here."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MODEL = "gemma-3-270m"


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
    batch_window_ms: float = 2.0
    scheduling_policy: str = "fcfs"
    enable_prefix_caching: bool = True
    quantization: str | None = None
    quantize_lm_head: bool = True  # with `quantization`: the (often tied) lm_head and embeddings too
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError("block_size must be a power of two")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.batch_window_ms < 0:
            raise ValueError("batch_window_ms must be >= 0")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"unknown scheduling_policy {self.scheduling_policy!r} (fcfs, priority)")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"unknown dtype {self.dtype!r} (auto, float32, bfloat16, float16)")

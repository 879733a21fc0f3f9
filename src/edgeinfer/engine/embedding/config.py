"""Frozen configuration of one resident embedding model."""

from __future__ import annotations

from dataclasses import dataclass

from edgeinfer.engine.config import EngineConfig
from edgeinfer.engine.model.bert import ATTENTION_MODES


@dataclass(frozen=True)
class EmbeddingConfig:
    """How one embedding model is served.

    `max_batch_tokens` / `max_batch_size`: one forward pass packs inputs (of any requests) up to these.
    `batch_window_ms`: inputs that arrive within this window of the oldest waiting one share a forward
    pass; a full batch goes at once. `attention`: `auto`, `packed`, `grouped` or `masked`
    (model/bert.py `choose_attention`; bench/embeddings.py measures them). `blocked_weights`: on the
    CPU, the linear layers also keep their weights in oneDNN's blocked layout (model/bert.py `Linear`).
    """

    model: str
    dtype: str = "auto"
    device: str = "cpu"
    max_batch_tokens: int = 8192
    max_batch_size: int = 512
    max_pass_tokens: int = 2048
    batch_window_ms: float = 2.0
    attention: str = "auto"
    blocked_weights: bool = True

    def __post_init__(self) -> None:
        if min(self.max_batch_tokens, self.max_batch_size, self.max_pass_tokens) < 1:
            raise ValueError("max_batch_tokens, max_batch_size and max_pass_tokens must be >= 1")
        if self.batch_window_ms < 0:
            raise ValueError("batch_window_ms must be >= 0")
        if self.attention not in ATTENTION_MODES:
            raise ValueError(f"attention {self.attention!r} (one of {', '.join(ATTENTION_MODES)})")
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"embedding dtype {self.dtype!r} (auto, float32, bfloat16)")

    @classmethod
    def from_engine_config(cls, config: EngineConfig, model: str) -> EmbeddingConfig:
        """The settings a node gives every local model that apply to an encoder."""
        # fp16 matmuls are far slower than bf16 on CPUs; an encoder never needs it.
        dtype = "auto" if config.dtype == "float16" else config.dtype
        return cls(model=model, dtype=dtype, device=config.device, batch_window_ms=config.batch_window_ms)

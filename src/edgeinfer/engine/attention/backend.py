"""The attention-backend interface: the model calls `attend`, the backend owns KV reads and writes."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from edgeinfer.engine.attention.metadata import AttentionMetadata
from edgeinfer.engine.attention.registry import ATTENTION_BACKENDS, load_class
from edgeinfer.engine.attention.storage import KVCacheStorage


class AttentionBackend(ABC):
    """Paged causal attention over a `KVCacheStorage`.

    The runner calls `begin(meta)` once per step; every attention layer then calls `attend`, which writes
    the step's new K/V into the cache and attends each query to its sequence's whole context.
    """

    # Set by the runner for a model whose layers run on our CPU kernels: a backend with a path through our
    # one-call decode ops (kernels/decode_ops.cpp) takes it; others ignore it.
    decode_ops = False

    def __init__(self, storage: KVCacheStorage) -> None:
        self.storage = storage
        self.meta: AttentionMetadata | None = None

    def begin(self, meta: AttentionMetadata) -> None:
        self.meta = meta

    @abstractmethod
    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, Dv] → [T, Hq, Dv]. `window`: keys with
        `q_pos - k_pos < window` only (HF sliding-window semantics); `softcap`: tanh logit cap."""


def get_attention_backend(name: str, storage: KVCacheStorage) -> AttentionBackend:
    """The backend registered as `name` (registry.py) over `storage`."""
    return load_class(ATTENTION_BACKENDS, name, "attention backend")(storage)

"""The attention-backend interface: the model calls `attend`, the backend owns KV reads and writes."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from edgeinfer.engine.attention.metadata import AttentionMetadata
from edgeinfer.engine.attention.storage import KVCacheStorage


class AttentionBackend(ABC):
    """Paged causal attention over a `KVCacheStorage`.

    The runner calls `begin(meta)` once per step; every attention layer then calls `attend`, which writes
    the step's new K/V into the cache and attends each query to its sequence's whole context.
    """

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


_BACKENDS: dict[str, type[AttentionBackend]] = {}


def register_backend(name: str):
    def wrap(cls: type[AttentionBackend]) -> type[AttentionBackend]:
        _BACKENDS[name] = cls
        return cls

    return wrap


def get_attention_backend(name: str, storage: KVCacheStorage) -> AttentionBackend:
    # Import here so that registering backends needs no import order from callers.
    from edgeinfer.engine.attention import torch_backend  # noqa: F401

    try:
        return _BACKENDS[name](storage)
    except KeyError:
        raise ValueError(f"unknown attention backend {name!r} (known: {', '.join(_BACKENDS)})") from None

"""Paged attention: KV storage, per-step metadata and backends (CPU now; CUDA slots in behind the ABC)."""

from edgeinfer.engine.attention.backend import AttentionBackend, get_attention_backend
from edgeinfer.engine.attention.metadata import AttentionMetadata
from edgeinfer.engine.attention.storage import KVCacheStorage, KVSpec

__all__ = ["AttentionBackend", "AttentionMetadata", "KVCacheStorage", "KVSpec", "get_attention_backend"]

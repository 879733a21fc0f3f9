"""The prepared-form cache: a loaded model's runtime tensors on disk, memory-mapped on the next load."""

from edgeinfer.engine.prepared.key import LAYOUT_VERSION, entry_key, source_digest
from edgeinfer.engine.prepared.snapshot import NotCacheable, capture, restore
from edgeinfer.engine.prepared.store import PreparedCache

__all__ = [
    "LAYOUT_VERSION",
    "NotCacheable",
    "PreparedCache",
    "capture",
    "entry_key",
    "restore",
    "source_digest",
]

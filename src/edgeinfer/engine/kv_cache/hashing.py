"""Chained block hashes. The first block's parent is the namespace, so equal prompts in different
namespaces (tenants) never share cache entries."""

from __future__ import annotations

import hashlib
from array import array


def namespace_root(namespace: str) -> bytes:
    return hashlib.sha256(b"edgeinfer-ns\0" + namespace.encode()).digest()


def chain_hashes(
    namespace: str, token_ids: list[int], block_size: int, start: int = 0, parent: bytes | None = None
) -> list[bytes]:
    """Hashes of the full blocks of `token_ids` from block index `start` (whose parent hash is given)."""
    h = parent if parent is not None else namespace_root(namespace)
    out = []
    for i in range(start, len(token_ids) // block_size):
        chunk = array("q", token_ids[i * block_size : (i + 1) * block_size]).tobytes()
        h = hashlib.sha256(h + chunk).digest()
        out.append(h)
    return out

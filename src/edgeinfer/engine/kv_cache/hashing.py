"""Chained block hashes. The first block's parent is the namespace, so equal prompts in different
namespaces (tenants) never share cache entries.

Public prefixes (declared by the operator, computed at load and pinned) hash under their own root. A
request that starts with one continues in its own namespace: its first private block's parent is
H(namespace root, last public hash), so the tail after a shared prefix stays the tenant's alone.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterator

from edgeinfer.types.cache_salt import encode_fields

# The namespace of public prefixes. Tenants' namespaces are server-derived hex salts (or "" when the
# engine is used without tenants), so none can equal it.
PUBLIC_NAMESPACE = "\0public"
# A request served through a LoRA adapter computes other K/V for the same tokens, so its namespace is its
# tenant's plus this mark and the adapter's content hash: no other adapter, nor the base, shares its
# blocks, and it never starts from the public prefixes (the base computed those).
_ADAPTER_MARK = "\0adapter:"


def adapter_namespace(namespace: str, adapter_fingerprint: str) -> str:
    return f"{namespace}{_ADAPTER_MARK}{adapter_fingerprint}"


def takes_public_prefixes(namespace: str) -> bool:
    return _ADAPTER_MARK not in namespace


def namespace_root(namespace: str) -> bytes:
    return hashlib.sha256(encode_fields("edgeinfer-kv-namespace", namespace)).digest()


def tail_root(namespace: str, public_parent: bytes | None) -> bytes:
    """The parent hash of a request's first block after `public_parent` (the last public block's hash)."""
    if public_parent is None:
        return namespace_root(namespace)
    if namespace == PUBLIC_NAMESPACE:
        return public_parent
    return hashlib.sha256(namespace_root(namespace) + public_parent).digest()


def iter_hashes(
    namespace: str, token_ids: list[int], block_size: int, start: int = 0, parent: bytes | None = None
) -> Iterator[bytes]:
    """Hashes of the full blocks of `token_ids` from block index `start` (whose parent hash is given)."""
    h = parent if parent is not None else namespace_root(namespace)
    for i in range(start, len(token_ids) // block_size):
        chunk = array("q", token_ids[i * block_size : (i + 1) * block_size]).tobytes()
        h = hashlib.sha256(h + chunk).digest()
        yield h


def chain_hashes(
    namespace: str, token_ids: list[int], block_size: int, start: int = 0, parent: bytes | None = None
) -> list[bytes]:
    return list(iter_hashes(namespace, token_ids, block_size, start, parent))

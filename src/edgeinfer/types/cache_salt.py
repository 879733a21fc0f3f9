"""Cache salts: keyed hashes of length-prefixed fields, shared by nodes and routers.

Each field is written as its 8-byte big-endian length followed by its UTF-8 bytes, so no two different
field lists encode to the same bytes (`("a/b", "c")` and `("a", "b/c")` differ), and the HMAC key keeps
salts unguessable by clients. Distinct tenants therefore never share a salt unless HMAC-SHA256 collides.
"""

from __future__ import annotations

import hashlib
import hmac

# The header a router sends a node the tenant's salt in (signed together with the tenant, router_trust).
SALT_HEADER = "x-edgeinfer-cache-salt"
# The field an upstream SGLang / vLLM member receives it in (both read it into their first block's hash).
UPSTREAM_FIELD = "cache_salt"


def encode_fields(*fields: str) -> bytes:
    out = bytearray()
    for value in fields:
        data = value.encode("utf-8")
        out += len(data).to_bytes(8, "big") + data
    return bytes(out)


def derive_salt(key: bytes, *fields: str) -> str:
    """HMAC-SHA256(key, length-prefixed fields), as 64 hex digits."""
    return hmac.new(key, encode_fields(*fields), hashlib.sha256).hexdigest()


def tenant_salt(key: bytes, tenant: str) -> str:
    """A tenant's cache namespace: stable per tenant and key, never set by a client."""
    return derive_salt(key, "edgeinfer-cache-namespace", tenant)

"""The tenant identity a router passes to nodes, signed with a secret that routers and nodes share.

Headers: `x-edgeinfer-tenant` (tenant name), `x-edgeinfer-tenant-ts` (unix seconds, as sent),
`x-edgeinfer-cache-salt` (the tenant's cache salt, types/cache_salt.py; optional) and
`x-edgeinfer-tenant-sig` = hex HMAC-SHA256(secret, length-prefixed tenant, ts, salt). A node configured
with the secret accepts the identity (and the salt as the tenant's cache namespace) when the signature
matches and the timestamp is within `MAX_SKEW_S` of its clock; a node without the secret ignores the
headers. Routers strip all four from client requests.
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

from edgeinfer.types.cache_salt import SALT_HEADER, derive_salt, encode_fields

TENANT_HEADER = "x-edgeinfer-tenant"
TS_HEADER = "x-edgeinfer-tenant-ts"
SIG_HEADER = "x-edgeinfer-tenant-sig"
TRUST_HEADERS = (TENANT_HEADER, TS_HEADER, SIG_HEADER, SALT_HEADER)
# Bounds how long a captured header stays usable; loose enough for unsynchronised clocks.
MAX_SKEW_S = 30.0
MIN_SECRET_BYTES = 16


def load_secret(path: str | Path) -> bytes:
    """The shared secret from a file (surrounding whitespace ignored); ValueError when too short."""
    secret = Path(path).read_bytes().strip()
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"{path}: the router secret must be at least {MIN_SECRET_BYTES} bytes")
    return secret


def cache_salt_key(secret: bytes) -> bytes:
    """The key of tenants' cache salts, from the secret routers share: every router derives the same salt
    for a tenant, so its prefix cache on a node is one namespace whichever router sent it."""
    return bytes.fromhex(derive_salt(secret, "edgeinfer-cache-salt-key"))


def sign(secret: bytes, tenant: str, ts: str, salt: str = "") -> str:
    return hmac.new(secret, encode_fields(tenant, ts, salt), hashlib.sha256).hexdigest()


def signed_headers(secret: bytes, tenant: str, now: float, salt: str = "") -> dict[str, str]:
    ts = f"{now:.3f}"
    headers = {TENANT_HEADER: tenant, TS_HEADER: ts, SIG_HEADER: sign(secret, tenant, ts, salt)}
    if salt:
        headers[SALT_HEADER] = salt
    return headers


def verify(secret: bytes, tenant: str, ts: str, sig: str, now: float, salt: str = "") -> bool:
    """True when `sig` signs `tenant`, `ts` and `salt`, and `ts` is within MAX_SKEW_S of `now`."""
    if not sig.isascii():  # never a hex digest; compare_digest refuses to compare such text (TypeError)
        return False
    try:
        age = abs(now - float(ts))
    except ValueError:
        return False
    return age <= MAX_SKEW_S and hmac.compare_digest(sign(secret, tenant, ts, salt), sig)

"""API keys: only their SHA-256 is ever stored (`python -m edgeinfer.node.keys` makes and hashes them)."""

from __future__ import annotations

import hashlib
import secrets

KEY_PREFIX = "ei-"


def hash_key(key: str) -> str:
    """Hex SHA-256 of an API key, as written in the tenants file."""
    if not key:
        raise ValueError("an API key must be non-empty")
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def generate_key() -> str:
    """A new random key (256 bits of entropy)."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def tenant_snippet(name: str, key: str) -> str:
    """The TOML entry for a tenants file."""
    return f'[[tenants]]\nname = "{name}"\nkey_sha256 = "{hash_key(key)}"\n'

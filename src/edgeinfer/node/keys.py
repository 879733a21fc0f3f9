"""API keys: only their SHA-256 is ever stored. `python -m edgeinfer.node.keys new NAME` makes one.

$ python -m edgeinfer.node.keys new acme
key (give it to the tenant, it is not stored):  ei-3q5...
[[tenants]]
name = "acme"
key_sha256 = "5c1e..."

$ python -m edgeinfer.node.keys hash ei-3q5...      # hash an existing key
"""

from __future__ import annotations

import hashlib
import secrets
import sys

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


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "new":
        key = generate_key()
        print(f"key (give it to the tenant, it is not stored):  {key}")
        print(tenant_snippet(argv[1], key), end="")
        return 0
    if len(argv) == 2 and argv[0] == "hash":
        print(hash_key(argv[1]))
        return 0
    print("usage: python -m edgeinfer.node.keys new NAME | hash KEY", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

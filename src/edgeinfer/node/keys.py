"""API keys: only their SHA-256 is ever stored. `python -m edgeinfer.node.keys new NAME` makes one.

$ python -m edgeinfer.node.keys new acme
key (give it to the tenant, it is not stored):  ei-3q5...
[[tenants]]
name = "acme"
key_sha256 = "5c1e..."

$ python -m edgeinfer.node.keys hash ei-3q5...      # hash an existing key
"""

from __future__ import annotations

import sys

from edgeinfer.api.keys import generate_key, hash_key, tenant_snippet


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

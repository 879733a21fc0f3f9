"""Request ids: the client's own `x-request-id` where it is tame, else a new one (node and router alike)."""

from __future__ import annotations

import re
import uuid

from starlette.types import Scope

# A client's (or the router's) own request id is kept when it is this tame; anything else is replaced.
_CLIENT_REQUEST_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/+=-]{0,127}")


def request_id_of(scope: Scope) -> str:
    """The client's own `x-request-id` when it is tame, else a new one."""
    for name, value in scope.get("headers", []):
        if name == b"x-request-id":
            text = value.decode("latin-1")
            if _CLIENT_REQUEST_ID.fullmatch(text):
                return text
            break
    return uuid.uuid4().hex

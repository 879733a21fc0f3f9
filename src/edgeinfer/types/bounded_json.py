"""JSON with a bounded nesting depth: what the servers parse request bodies (and JSON given as text inside
them, such as a schema) with. Torch-free.

Python's recursion limit is the only bound otherwise, and whatever reads a deeply nested value recursively
(the stdlib parser itself, a validator, a template, a native library) fails with a RecursionError, or, in
native code, overflows the stack.
"""

from __future__ import annotations

import json
from typing import Any

# Arrays and objects inside one another; no API body needs more (a JSON schema in `response_format`
# nests two levels per object property, which leaves room for half as many levels of properties).
MAX_JSON_DEPTH = 64


def loads(data: str | bytes) -> Any:
    """The JSON value of `data`; json.JSONDecodeError (a ValueError) when it is not JSON, not UTF-8, or
    nested deeper than MAX_JSON_DEPTH."""
    try:
        value = json.loads(data)
    except RecursionError:  # the stdlib parser recurses once per level
        raise too_deep() from None
    except UnicodeDecodeError as exc:
        raise json.JSONDecodeError(f"not valid UTF-8 ({exc.reason})", "", exc.start) from None
    if nesting_depth(value, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
        raise too_deep()
    return value


def nesting_depth(value: Any, stop_above: int) -> int:
    """How deeply arrays and objects nest in `value` (a scalar: 0, `[]`: 1), counted level by level without
    recursion; the count stops at `stop_above + 1`."""
    depth = 0
    level = [value] if type(value) is dict or type(value) is list else []
    while level and depth <= stop_above:
        depth += 1
        inner: list[Any] = []
        for container in level:
            # Plain loops and exact type tests (json.loads makes no subclasses): this walks every value of
            # bodies up to the size limit.
            for item in container.values() if type(container) is dict else container:
                if type(item) is list or type(item) is dict:
                    inner.append(item)
        level = inner
    return depth


def too_deep() -> json.JSONDecodeError:
    return json.JSONDecodeError(f"nested deeper than {MAX_JSON_DEPTH} levels", "", 0)

"""The JSON schemas the structured-output tests constrain tiny random models with (schemas.json, one a
line): nested objects, bounded arrays, enums, required and optional properties, ranged numbers, string
formats and patterns, $defs references and unions -- each kind the grammar library supports. Strings are
bounded so that a random model's answers stay short; the grammar, not the model, makes them valid."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SCHEMAS: list[dict[str, Any]] = json.loads((Path(__file__).parent / "schemas.json").read_text())

# Invalid schemas and schemas the library cannot honour: each is refused with a 400 naming the problem.
UNSUPPORTED: list[tuple[dict[str, Any], str]] = [
    ({"type": "object", "properties": {"a": {"type": "strin"}}}, "strin"),
    ({"type": "string", "format": "not-a-format"}, "not-a-format"),
    ({"not": {"type": "string"}}, "not"),
    ({"type": "string", "minLength": 5, "maxLength": 2}, "minLength"),
    ({"$ref": "#/$defs/missing"}, "missing"),
    ({"type": "string", "pattern": "(?<=a)b"}, "look-around"),
    ({"type": "array", "uniqueItems": True}, "uniqueItems"),
]

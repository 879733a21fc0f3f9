"""Reading the node's JSON or TOML configuration files."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any


def load_table(path: str | Path) -> dict[str, Any]:
    """Parse `path` as TOML (`.toml`) or JSON (anything else); the top level must be a table/object."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"cannot read {p}: {exc.strerror or exc}") from exc
    try:
        data = tomllib.loads(text) if p.suffix.lower() == ".toml" else json.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(
            f"{p} is not valid {'TOML' if p.suffix.lower() == '.toml' else 'JSON'}: {exc}"
        ) from exc
    if not isinstance(data, dict):
        raise ValueError(f"{p}: the top level must be a table/object")
    return data

"""The body of `GET /v1/usage`, the same on a node (its own store) and a router (the fleet ledger)."""

from __future__ import annotations

from typing import Any

SUMMED = ("requests", "input_tokens", "cached_input_tokens", "output_tokens", "cost_units")


def usage_body(
    tenant: str, start: float | None, end: float | None, rows: list[dict[str, Any]]
) -> dict[str, Any]:
    """`rows`: one per model, with the SUMMED keys; `total`: their sums."""
    total = {key: sum(row[key] for row in rows) for key in SUMMED}
    return {"object": "usage", "tenant": tenant, "start": start, "end": end, "data": rows, "total": total}

"""One request's usage as the fleet ledger carries it: nodes publish it on NATS JetStream, the ledger
(`edgeinfer ledger`) stores it once, routers settle their tenants' token reservations from it."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from typing import Any

# Nodes publish on `edgeinfer.usage.<node_id>`, into the stream USAGE_STREAM (which keeps every subject
# under USAGE_SUBJECT_PREFIX); a subscriber takes `edgeinfer.usage.>`.
USAGE_SUBJECT_PREFIX = "edgeinfer.usage"
USAGE_STREAM = "EDGEINFER_USAGE"
_INTS = ("status", "input_tokens", "cached_input_tokens", "output_tokens")
_STRS = ("request_id", "node_id", "tenant", "model", "endpoint")


@dataclass(frozen=True, kw_only=True)
class UsageEvent:
    """What one request consumed on one node. `event_id` (`<node_id>/<request_id>`) is the idempotency
    key: the same event delivered twice is billed once. `ts`: unix seconds when the request ended;
    `ttft_ms` / `duration_ms`: its first token and its whole time on the node (None where unknown);
    `http_request_id`: the HTTP request's `x-request-id` (a router's own, behind a router), by which
    the router that admitted the request settles its token reservation (None where unknown)."""

    request_id: str
    node_id: str
    tenant: str
    model: str
    endpoint: str
    status: int
    input_tokens: int
    cached_input_tokens: int
    output_tokens: int
    cost_units: float
    ts: float
    ttft_ms: float | None = None
    duration_ms: float | None = None
    http_request_id: str | None = None

    @property
    def event_id(self) -> str:
        return f"{self.node_id}/{self.request_id}"

    @property
    def subject(self) -> str:
        return f"{USAGE_SUBJECT_PREFIX}.{self.node_id}"

    @property
    def total_tokens(self) -> int:
        return self.input_tokens + self.output_tokens

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes | str) -> UsageEvent:
        """ValueError on anything that is not a well-formed event (a ledger keeps those aside)."""
        try:
            raw = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"usage event: not JSON ({exc})") from None
        if not isinstance(raw, dict):
            raise ValueError("usage event: not a JSON object")
        for name in _STRS:
            if not isinstance(raw.get(name), str) or not raw[name]:
                raise ValueError(f"usage event: {name} must be a non-empty string")
        for name in _INTS:
            value = raw.get(name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"usage event {raw['request_id']}: {name} must be an integer >= 0")
        numbers = {
            name: _number(raw, name, optional=name in ("ttft_ms", "duration_ms"))
            for name in ("cost_units", "ts", "ttft_ms", "duration_ms")
        }
        http_request_id = raw.get("http_request_id")
        if http_request_id is not None and not isinstance(http_request_id, str):
            raise ValueError(f"usage event {raw['request_id']}: http_request_id must be a string")
        return cls(
            **{name: raw[name] for name in (*_STRS, *_INTS)}, **numbers, http_request_id=http_request_id
        )


def _number(raw: dict[str, Any], name: str, optional: bool) -> float | None:
    value = raw.get(name)
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise ValueError(f"usage event {raw['request_id']}: {name} must be a finite number >= 0")
    return float(value)

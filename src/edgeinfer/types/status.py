"""What a node reports to routers (on NATS at >= 10 Hz, or on `GET /node/status`)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

# Subjects are `edgeinfer.status.<node_id>`; routers subscribe to `edgeinfer.status.>`.
STATUS_SUBJECT_PREFIX = "edgeinfer.status"


@dataclass(frozen=True)
class NodeStatus:
    """One node's state. Model lists hold every name a model answers to (aliases included).

    `models_embedding`: the names (of `models_available`) that answer with vectors (/v1/embeddings,
    Workers-AI text embeddings) rather than text. `capacity`: requests the node runs at once (its resident
    engines' sequence slots); `kv_usage`: the fullest resident engine's KV cache in [0, 1]; `ts`: unix
    seconds when the node took the snapshot.
    """

    node_id: str
    location: str
    models_available: tuple[str, ...] = ()
    models_warm: tuple[str, ...] = ()
    models_loading: tuple[str, ...] = ()
    models_embedding: tuple[str, ...] = ()
    adapters_warm: tuple[str, ...] = ()  # LoRA adapters loaded in an engine (api/adapters.adapter_key)
    queue_depth: int = 0
    running: int = 0
    kv_usage: float = 0.0
    capacity: int = 1
    ts: float = 0.0

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes | str | dict[str, Any]) -> NodeStatus:
        """ValueError on anything that is not a well-formed status."""
        raw = json.loads(data) if isinstance(data, bytes | str) else data
        if not isinstance(raw, dict) or not isinstance(raw.get("node_id"), str) or not raw["node_id"]:
            raise ValueError("node status: needs a non-empty node_id")
        try:
            return cls(
                node_id=raw["node_id"],
                location=str(raw.get("location", "")),
                models_available=tuple(map(str, raw.get("models_available", ()))),
                models_warm=tuple(map(str, raw.get("models_warm", ()))),
                models_loading=tuple(map(str, raw.get("models_loading", ()))),
                models_embedding=tuple(map(str, raw.get("models_embedding", ()))),
                adapters_warm=tuple(map(str, raw.get("adapters_warm", ()))),
                queue_depth=int(raw.get("queue_depth", 0)),
                running=int(raw.get("running", 0)),
                kv_usage=float(raw.get("kv_usage", 0.0)),
                capacity=int(raw.get("capacity", 1)),
                ts=float(raw.get("ts", 0.0)),
            )
        except (TypeError, ValueError) as exc:
            raise ValueError(f"node status {raw.get('node_id')}: {exc}") from None

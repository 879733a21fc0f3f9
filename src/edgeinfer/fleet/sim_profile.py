"""Node service-time profiles (JSON), measured from our engine by bench/fleet_profile.py.

Per model: prefill throughput, a linear fit of the decode step time against batch size and the batch's total
context, the cold-load time, and the memory a resident model takes (weights + its KV budget).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ModelProfile:
    prefill_tok_s: float
    prefill_overhead_ms: float  # fixed cost of one prefill step
    step_base_ms: float  # decode step = base + per_seq x batch + per_kctx x (total context / 1000)
    step_per_seq_ms: float
    step_per_kctx_ms: float
    load_s: float
    weights_gb: float
    kv_tokens: int  # the KV budget of one resident copy, in tokens
    kv_gb: float
    # What serving adds per request on the node's clock (HTTP, tokenizing, the first event), beside the
    # engine's prefill; it queues like the prefill. Engine-only profiles leave it 0.
    request_overhead_ms: float = 0.0

    def prefill_s(self, tokens: int, requests: int = 1) -> float:
        """One prefill step of `requests` requests with `tokens` tokens to compute between them."""
        ms = (
            self.prefill_overhead_ms
            + self.request_overhead_ms * requests
            + 1000 * tokens / self.prefill_tok_s
        )
        return ms / 1000

    def step_s(self, batch: int, total_context: float) -> float:
        ms = self.step_base_ms + self.step_per_seq_ms * batch + self.step_per_kctx_ms * total_context / 1000
        return ms / 1000

    @property
    def memory_gb(self) -> float:
        return self.weights_gb + self.kv_gb


@dataclass(frozen=True)
class Profile:
    device: str
    source: str
    models: dict[str, ModelProfile]

    def model(self, name: str) -> ModelProfile:
        if name not in self.models:
            raise ValueError(f"profile has no model {name!r} (has: {', '.join(self.models)})")
        return self.models[name]


def load_profile(path: str | Path) -> Profile:
    raw = json.loads(Path(path).read_text())
    return parse_profile(raw)


def parse_profile(raw: dict[str, Any]) -> Profile:
    models = {name: ModelProfile(**entry) for name, entry in raw["models"].items()}
    return Profile(device=raw.get("device", "?"), source=raw.get("source", "?"), models=models)

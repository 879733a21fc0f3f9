"""Small simulator scenarios for the fleet tests: a fixed-cost profile, one location, explicit arrivals."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from edgeinfer.fleet.sim_demand import Arrivals

SERVICE_S = 0.05


def write_profile(path: Path, **overrides) -> Path:
    model = dict(
        prefill_tok_s=1e12, prefill_overhead_ms=SERVICE_S * 1000, step_base_ms=10.0, step_per_seq_ms=0.0,
        step_per_kctx_ms=0.0, load_s=2.0, weights_gb=1.0, kv_tokens=100_000, kv_gb=1.0,
    )  # fmt: skip
    model.update(overrides)
    path.write_text(json.dumps({"device": "test", "source": "fixed", "models": {"m": model}}))
    return path


def one_location(tmp_path: Path, rate: float, duration_s: float, **nodes) -> dict:
    write_profile(tmp_path / "p.json")
    return {
        "seed": 7,
        "duration_s": duration_s,
        "locations": {"source": "list", "sites": [{"code": "AAA", "lat": 10.0, "lon": 20.0}]},
        "network": {"last_mile_ms": 0.0},
        "demand": {"requests_per_s": rate, "diurnal_amplitude": 0.0, "session_share": 0.0},
        "models": [
            {
                "name": "m",
                "profile": "m",
                "prompt_tokens": {"dist": "fixed", "median": 16},
                "output_tokens": {"dist": "fixed", "median": 1},
            }
        ],
        "nodes": {"profile": "p.json", "per_location": [1], "busy_queue": 10**9, **nodes},
        "policies": ["router"],
    }


def arrivals_of(rows: list[tuple[float, int, int, int, int]]) -> Arrivals:
    t, prompt, output, key, plen = (np.array(c) for c in zip(*rows, strict=True))
    zeros = np.zeros(len(rows), dtype=np.int64)
    return Arrivals(t.astype(float), zeros, zeros, prompt, output, key, plen)

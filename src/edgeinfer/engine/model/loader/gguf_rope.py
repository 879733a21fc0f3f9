"""Recovering Llama 3's `rope_scaling` from the `rope_freqs` tensor llama.cpp writes instead of it.

llama.cpp's converter evaluates Llama 3's frequency schedule into one divisor per rotary pair and stores only
that: 1 for high frequencies (wavelength < original_context / high_freq_factor), `factor` for low ones
(wavelength > original_context / low_freq_factor), and in between 1 / ((1 - s) / factor + s) with
s = (original_context / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor).

So `factor` is the plateau, and each in-between divisor gives s, which is linear in 1 / wavelength:
s = a / wavelength - b with a = original_context / (high - low) and b = low / (high - low). Only these two
ratios matter to the schedule, so with low_freq_factor = 1 (Meta's value in every Llama 3 release) the
original parameters come back exactly; any other triple with the same ratios gives identical frequencies.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from edgeinfer.engine.model.loader.errors import CheckpointError

_TOLERANCE = 1e-4


def llama3_rope_scaling(
    divisors: np.ndarray, theta: float, head_dim: int, path: Path
) -> dict[str, Any] | None:
    """HF `rope_scaling` (rope_type llama3) reproducing `divisors`, or None if they scale nothing."""
    divisors = divisors.astype(np.float64).reshape(-1)
    if len(divisors) != head_dim // 2:
        raise CheckpointError(f"{path}: rope_freqs has {len(divisors)} entries, expected {head_dim // 2}")
    factor = float(divisors.max())
    if factor <= 1 + _TOLERANCE:
        return None
    inv_freq = theta ** -(np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    between = (divisors > 1 + _TOLERANCE) & (divisors < factor * (1 - _TOLERANCE))
    if between.sum() < 2:
        raise CheckpointError(
            f"{path}: rope_freqs has too few smoothed entries to recover llama3 rope scaling"
        )
    smooth = (1 / divisors[between] - 1 / factor) / (1 - 1 / factor)
    slope, intercept = np.polyfit(inv_freq[between] / (2 * math.pi), smooth, 1)
    low = 1.0
    high = low + low / -intercept
    return {
        "rope_type": "llama3",
        "factor": round(factor, 4),
        "low_freq_factor": low,
        "high_freq_factor": round(high, 4),
        "original_max_position_embeddings": round(slope * (high - low)),
    }

"""Garbage-output canary: cheap checks on finished generations that flag a broken model or kernel.

NaN/Inf logits are detected by the engine (the request finishes with an error); this module adds the
output-side check — degenerate repetition — and names the canary kinds counted in metrics.
"""

from __future__ import annotations

from collections.abc import Sequence

NONFINITE_LOGITS = "nonfinite_logits"
DEGENERATE_REPETITION = "degenerate_repetition"

# A 32-token tail made of one pattern of at most 8 tokens is at least four repeats: healthy models at
# ordinary temperatures almost never do this, broken weights or a bad quantization do it constantly.
DEFAULT_WINDOW = 32
DEFAULT_MAX_PERIOD = 8


def is_degenerate_repetition(
    token_ids: Sequence[int], window: int = DEFAULT_WINDOW, max_period: int = DEFAULT_MAX_PERIOD
) -> bool:
    """True when the last `window` tokens repeat a pattern of period <= `max_period`.

    Outputs shorter than `window` are never flagged, so short answers cannot trip it.
    """
    if window < 2 or max_period < 1:
        raise ValueError("window must be >= 2 and max_period >= 1")
    if len(token_ids) < window:
        return False
    tail = list(token_ids[-window:])
    return any(_has_period(tail, period) for period in range(1, min(max_period, window // 2) + 1))


def _has_period(tokens: list[int], period: int) -> bool:
    return all(tokens[i] == tokens[i - period] for i in range(period, len(tokens)))

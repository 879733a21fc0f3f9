"""How long a step of n tokens takes here, learned from the steps already run: t ≈ a + b·n.

The scheduler turns a step-time target into its token budget with it, so one long prompt's prefill
chunks stay short enough that a request arriving meanwhile waits at most about one target for the step
in flight, on whatever hardware the engine runs: far below the maximum for a small model on a few CPU
cores, the configured maximum on a GPU, where a step of that many tokens is fast. The fit is an exponentially
weighted least-squares line over recent steps (the machine's speed drifts with its load); until steps of
different sizes have been seen there is no slope to trust, and the budget stays at its maximum. Once there
was one, it holds while the recent steps are all of one size (as a budgeted step makes them): forgetting it
then would lift the budget to its maximum for the next step, the one long step the budget is there to avoid.
"""

from __future__ import annotations

from dataclasses import dataclass

# weight of the newest step: about the last 20 steps count
_DECAY = 0.05
# a spread of step sizes (tokens², weighted) below which the line is not fitted
_MIN_VARIANCE = 16.0


@dataclass
class StepCost:
    n: float = 0.0
    t: float = 0.0
    nn: float = 0.0
    nt: float = 0.0
    seen: int = 0
    fit: tuple[float, float] | None = None  # the last line the steps gave

    def observe(self, tokens: int, seconds: float) -> None:
        w = 1.0 if self.seen == 0 else _DECAY
        self.n += w * (tokens - self.n)
        self.t += w * (seconds - self.t)
        self.nn += w * (tokens * tokens - self.nn)
        self.nt += w * (tokens * seconds - self.nt)
        self.seen += 1

    def line(self) -> tuple[float, float] | None:
        """(a, b): seconds per step and per token; None until steps of different sizes were seen; the last
        line while recent steps give none."""
        variance = self.nn - self.n * self.n
        if variance < _MIN_VARIANCE:
            return self.fit
        slope = (self.nt - self.n * self.t) / variance
        if slope <= 0:
            return self.fit
        self.fit = max(self.t - slope * self.n, 0.0), slope
        return self.fit

    def tokens_within(self, seconds: float, lowest: int, highest: int) -> int:
        """The most tokens a step can take and still end within `seconds`, in [lowest, highest]."""
        fit = self.line()
        if fit is None:
            return highest
        fixed, per_token = fit
        return max(lowest, min(highest, round((seconds - fixed) / per_token)))

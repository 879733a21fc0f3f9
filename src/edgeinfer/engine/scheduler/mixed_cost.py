"""How long a step of d decode rows and p prefill tokens takes here, learned from every step run:
t ≈ a + b·d + c·p.

A decode row costs a fraction of a prefill token on a CPU (its weights are read once for all rows, and a
decode row skips nothing a prefill token computes but the prompt's attention), so a step beside interactive
decodes, which runs decodes and maybe a little prefill, is sized by this model and not by the line of all
steps (scheduler/step_cost.py), whose fixed cost and slope are a prefill step's. Fitted as that line is
(exponentially weighted least squares over recent steps), on every step: the mix of steps a busy node runs
(prefill chunks, decode steps of any size, both together) is what tells the two slopes apart. Until it can
(its normal equations near singular) and while a fit gives a negative term, the last fit stands (None
before the first).
"""

from __future__ import annotations

from dataclasses import dataclass, field

_DECAY = 0.05  # the newest step's weight: about the last 20 steps count
_MIN_PIVOT = 1e-6  # relative: a pivot below this (times the matrix's scale) means no fit
_ROUNDING = 1e-6  # a count that fits exactly stays whole when the division lands a hair below it


def _solve3(m: list[list[float]], v: list[float]) -> list[float] | None:
    """m·x = v by Gaussian elimination with partial pivoting; None where m is near singular."""
    a = [row[:] + [v[i]] for i, row in enumerate(m)]
    scale = max(abs(x) for row in m for x in row) or 1.0
    for col in range(3):
        pivot = max(range(col, 3), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < _MIN_PIVOT * scale:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(col + 1, 3):
            f = a[r][col] / a[col][col]
            for k in range(col, 4):
                a[r][k] -= f * a[col][k]
    x = [0.0, 0.0, 0.0]
    for r in (2, 1, 0):
        x[r] = (a[r][3] - sum(a[r][k] * x[k] for k in range(r + 1, 3))) / a[r][r]
    return x


@dataclass
class MixedStepCost:
    xx: list[list[float]] = field(default_factory=lambda: [[0.0] * 3 for _ in range(3)])
    xt: list[float] = field(default_factory=lambda: [0.0] * 3)
    seen: int = 0
    fit: tuple[float, float, float] | None = None  # (a, b, c): seconds per step, decode row, prefill token

    def observe(self, decodes: int, prefill: int, seconds: float) -> None:
        x = (1.0, float(decodes), float(prefill))
        w = 1.0 if self.seen == 0 else _DECAY
        for i in range(3):
            self.xt[i] += w * (x[i] * seconds - self.xt[i])
            for j in range(3):
                self.xx[i][j] += w * (x[i] * x[j] - self.xx[i][j])
        self.seen += 1
        found = _solve3(self.xx, self.xt)
        if found is not None and min(found) >= 0 and found[1] > 0 and found[2] > 0:
            self.fit = (found[0], found[1], found[2])

    def plan(self, seconds: float, decodes: int, lowest: int, budget: int) -> tuple[int, bool] | None:
        """(tokens, decodes only) for a step of at most `seconds` that owes `decodes` decode rows: as many
        of them as fit (at least `lowest`), and where all fit, prefill tokens in the time left. None
        without a fit yet."""
        if self.fit is None:
            return None
        fixed, per_row, per_token = self.fit
        rows = int((seconds - fixed) / per_row + _ROUNDING)
        if rows <= decodes:
            return max(lowest, min(rows, budget)), True
        extra = int((seconds - fixed - per_row * decodes) / per_token + _ROUNDING)
        return min(budget, decodes + extra), extra <= 0

"""A price in cost units (like Workers AI's neurons), as the prices file and tenants' overrides write it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

PER_TOKENS = 1_000_000  # prices are cost units per million tokens


@dataclass(frozen=True)
class Price:
    """Cost units per million input, cached-input and output tokens; `batch`: the factor on the cost of
    queued work (the Batch API), which waits for spare capacity (e.g. 0.5 for half price)."""

    input: float = 100.0
    cached_input: float = 10.0
    output: float = 400.0
    batch: float = 1.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int | float) or value < 0:
                raise ValueError(f"price {f.name} must be a number >= 0, got {value!r}")

    def cost(
        self, input_tokens: int, cached_input_tokens: int, output_tokens: int, *, batch: bool = False
    ) -> float:
        """Cached tokens are billed at `cached_input`, the rest of the prompt at `input`."""
        uncached = max(0, input_tokens - cached_input_tokens)
        units = uncached * self.input + cached_input_tokens * self.cached_input + output_tokens * self.output
        return units / PER_TOKENS * (self.batch if batch else 1.0)

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], base: Price | None = None, where: str = "price") -> Price:
        """Fields missing from `data` come from `base` (or the defaults)."""
        if not isinstance(data, Mapping):
            raise ValueError(f"{where}: must be a table/object of input, cached_input, output, batch")
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(
                f"{where}: unknown price field(s) {sorted(unknown)} (input, cached_input, output, batch)"
            )
        values = {name: getattr(base or cls(), name) for name in known}
        values.update(data)
        return cls(**values)

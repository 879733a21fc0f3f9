"""Cost units per model (like Workers AI's neurons), with cached input tokens discounted."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

PER_TOKENS = 1_000_000  # prices are cost units per million tokens


@dataclass(frozen=True)
class Price:
    """Cost units per million input, cached-input and output tokens."""

    input: float = 100.0
    cached_input: float = 10.0
    output: float = 400.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int | float) or value < 0:
                raise ValueError(f"price {f.name} must be a number >= 0, got {value!r}")

    def cost(self, input_tokens: int, cached_input_tokens: int, output_tokens: int) -> float:
        """Cached tokens are billed at `cached_input`, the rest of the prompt at `input`."""
        uncached = max(0, input_tokens - cached_input_tokens)
        units = uncached * self.input + cached_input_tokens * self.cached_input + output_tokens * self.output
        return units / PER_TOKENS

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], base: Price | None = None, where: str = "price") -> Price:
        """Fields missing from `data` come from `base` (or the defaults)."""
        if not isinstance(data, Mapping):
            raise ValueError(f"{where}: must be a table/object of input, cached_input, output")
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(
                f"{where}: unknown price field(s) {sorted(unknown)} (input, cached_input, output)"
            )
        values = {name: getattr(base or cls(), name) for name in known}
        values.update(data)
        return cls(**values)


class PriceTable:
    """A default price, per-model prices, and per-tenant per-model overrides on top."""

    def __init__(self, default: Price | None = None, models: Mapping[str, Price] | None = None) -> None:
        self.default = default or Price()
        self.models = dict(models or {})

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> PriceTable:
        """`{"default": {...}, "models": {"name": {...}}}` — the layout of a `--prices` file."""
        unknown = set(data) - {"default", "models"}
        if unknown:
            raise ValueError(f"prices: unknown key(s) {sorted(unknown)} (default, models)")
        default = Price.from_mapping(data.get("default", {}), where="prices.default")
        models = {
            name: Price.from_mapping(entry, default, where=f"prices.models.{name}")
            for name, entry in data.get("models", {}).items()
        }
        return cls(default, models)

    def price(self, model: str, overrides: Mapping[str, Mapping[str, float]] | None = None) -> Price:
        """The model's price, with a tenant's partial override (some fields) applied on top."""
        base = self.models.get(model, self.default)
        if overrides and model in overrides:
            return Price.from_mapping(overrides[model], base, where=f"override for {model}")
        return base

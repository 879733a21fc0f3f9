"""Cost units per model (like Workers AI's neurons), with cached input tokens discounted."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from edgeinfer.api.prices import Price


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

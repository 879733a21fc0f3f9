"""The fleet simulator: queueing against M/D/1, continuous batching and the prefix cache step by step,
determinism, and that the router's own policy module makes the routing decisions."""

from __future__ import annotations

import importlib
import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from helpers.fleet_sim import SERVICE_S, arrivals_of, one_location, write_profile

from edgeinfer.fleet import sim_policies
from edgeinfer.fleet.sim_demand import Arrivals
from edgeinfer.fleet.sim_fleet import SimFleet
from edgeinfer.fleet.sim_profile import parse_profile
from edgeinfer.fleet.sim_report import all_metrics, deterministic
from edgeinfer.fleet.sim_run import build_locations, simulate
from edgeinfer.fleet.sim_scenario import parse_scenario


def test_queueing_delay_matches_md1(tmp_path):
    # One server, Poisson arrivals, fixed service time (a prefill of fixed cost, one output token, batch 1).
    rate = 10.0  # rho = 0.5
    scenario = parse_scenario(one_location(tmp_path, rate, 2000.0, max_batch=1), base_dir=tmp_path)
    result = simulate(scenario)
    rec = result.runs[0].fleet.records
    wait = rec.ttft - SERVICE_S
    rho = rate * SERVICE_S
    expected = rho * SERVICE_S / (2 * (1 - rho))  # Pollaczek-Khinchine for M/D/1
    assert len(wait) > 15_000
    assert np.mean(wait) == pytest.approx(expected, rel=0.1)
    # An arrival finds the server idle with probability 1 - rho (PASTA).
    assert np.mean(wait < 1e-9) == pytest.approx(1 - rho, abs=0.03)


def _fleet(tmp_path: Path, arrivals: Arrivals, router_ms: float = 0.0, **profile) -> SimFleet:
    raw = one_location(tmp_path, 1.0, 100.0)
    raw["network"]["router_ms"] = router_ms
    write_profile(tmp_path / "p.json", **profile)
    raw["models"][0]["system_prompt_tokens"] = 0
    scenario = parse_scenario(raw, base_dir=tmp_path)
    prof = parse_profile(json.loads((tmp_path / "p.json").read_text()))
    fleet = SimFleet(scenario, prof, build_locations(scenario), len(arrivals))
    fleet.env.process(fleet.feed(arrivals, sim_policies.make_policy("router", fleet)))
    fleet.env.run()
    return fleet


def test_continuous_batching_joins_at_step_boundaries(tmp_path):
    # Prefill: 10 ms + 1 ms per 100 tokens. Decode step: 10 ms + 5 ms per running sequence.
    profile = dict(prefill_tok_s=100_000.0, prefill_overhead_ms=10.0, step_base_ms=10.0, step_per_seq_ms=5.0)
    arrivals = arrivals_of([(0.0, 100, 5, 0, 0), (0.0, 100, 5, 0, 0), (0.033, 100, 3, 0, 0)])
    rec = _fleet(tmp_path, arrivals, **profile).records
    # Both t=0 requests share one prefill of 200 tokens: 12 ms.
    assert rec.ttft[:2] == pytest.approx([0.012, 0.012])
    # Batch of 2 steps at 20 ms from 12 ms; the newcomer at 33 ms waits for the step ending at 52 ms,
    # then its prefill (11 ms) runs alone: first token at 63 ms, 30 ms after arrival.
    assert rec.ttft[2] == pytest.approx(0.063 - 0.033)
    # The first two had 3 of their 5 tokens at 52 ms, the newcomer 1 of 3 at 63 ms: all three need 2 more
    # steps, now of 25 ms (batch 3), and finish together at 113 ms.
    assert rec.e2e[:2] == pytest.approx([0.113, 0.113])
    assert rec.e2e[2] == pytest.approx(0.113 - 0.033)


def test_serving_costs_per_request_on_the_node_and_the_router_hop_as_latency(tmp_path):
    # Prefill: 10 ms a step + 4 ms per request + 1 ms per 100 tokens; the router's hop adds 3 ms.
    profile = dict(prefill_tok_s=100_000.0, prefill_overhead_ms=10.0, request_overhead_ms=4.0)
    arrivals = arrivals_of([(0.0, 100, 1, 0, 0), (0.0, 100, 1, 0, 0), (1.0, 100, 1, 0, 0)])
    rec = _fleet(tmp_path, arrivals, router_ms=3.0, **profile).records
    # Both t=0 requests share one step that pays the per-request cost twice: 10 + 8 + 2 = 20 ms.
    assert rec.ttft[:2] == pytest.approx([0.023, 0.023])
    # Alone: 10 + 4 + 1 = 15 ms on the node, and the hop.
    assert rec.ttft[2] == pytest.approx(0.018)
    assert rec.e2e.tolist() == pytest.approx(rec.ttft.tolist())


def test_prefix_cache_hit_on_second_turn(tmp_path):
    # A session's second turn repeats its 4,000-token prefix; prefill runs at 10,000 tokens/s.
    profile = dict(prefill_tok_s=10_000.0, prefill_overhead_ms=0.0)
    arrivals = arrivals_of([(0.0, 4100, 2, 5, 4000), (10.0, 4100, 2, 5, 4000), (20.0, 4100, 2, 6, 4000)])
    rec = _fleet(tmp_path, arrivals, **profile).records
    assert rec.cached.tolist() == [0, 4000, 0]
    assert rec.ttft.tolist() == pytest.approx([0.41, 0.01, 0.41])


def _three_locations(seed: int):
    scenario = parse_scenario(
        {
            "seed": seed,
            "duration_s": 120.0,
            "locations": {"source": "list", "sites": [
                {"code": "FRA", "lat": 50.03, "lon": 8.57, "population": 5},
                {"code": "AMS", "lat": 52.31, "lon": 4.76, "population": 3},
                {"code": "WAW", "lat": 52.17, "lon": 20.97, "population": 2},
            ]},
            "demand": {"requests_per_s": 6.0, "bursts_per_day": 2000.0, "session_share": 0.4},
            "models": [
                {"name": "a", "profile": "m", "popularity": 3, "system_prompt_tokens": 64,
                 "output_tokens": {"median": 32, "max": 256}},
                {"name": "b", "profile": "m", "popularity": 1, "output_tokens": {"median": 32, "max": 256}},
            ],
            "nodes": {"profile": "p.json", "per_location": [2, 1, 1], "memory_gb": 2.0, "busy_queue": 8},
        },
        base_dir=Path(__file__).parent,
    )  # fmt: skip
    return scenario


@pytest.fixture
def three_locations(tmp_path):
    write_profile(tmp_path / "p.json", prefill_tok_s=5000.0, step_base_ms=20.0, step_per_seq_ms=2.0)
    return lambda seed: replace(_three_locations(seed), base_dir=tmp_path)


def test_same_seed_same_report(three_locations):
    first = deterministic(all_metrics(simulate(three_locations(1))))
    again = deterministic(all_metrics(simulate(three_locations(1))))
    other = deterministic(all_metrics(simulate(three_locations(2))))
    assert set(first) == {"router", "nearest", "least-loaded", "round-robin"}
    assert first == again
    assert first != other


def test_simulator_routes_through_the_router_policy_module(three_locations):
    module = importlib.import_module("edgeinfer.router.policy")
    assert sim_policies.router_policy is module
    assert sim_policies.RouterPolicy.module is module
    assert Path(module.decide.__code__.co_filename).parts[-3:] == ("edgeinfer", "router", "policy.py")
    # Count calls of that very function object's code while the simulator runs, without replacing it.
    calls = []

    def profiler(frame, event, arg):
        if event == "call" and frame.f_code is module.decide.__code__:
            calls.append(frame.f_locals["strategy"])

    sys.setprofile(profiler)
    try:
        result = simulate(replace(three_locations(3), policies=("router", "least-loaded")))
    finally:
        sys.setprofile(None)
    assert calls and set(calls) == {"ttft"}
    assert len(calls) == len(result.arrivals) == result.runs[0].fleet.records.node.size


def test_least_loaded_skips_saturated_nodes_and_loads_a_cold_copy(tmp_path):
    raw = one_location(tmp_path, 1.0, 100.0, busy_queue=1, per_location=[1, 1, 1])
    raw["locations"]["sites"] = [{"code": c, "lat": 10.0, "lon": 20.0 + i} for i, c in enumerate("ABC")]
    scenario = parse_scenario(raw, base_dir=tmp_path)
    prof = parse_profile(json.loads((tmp_path / "p.json").read_text()))
    arrivals = arrivals_of([(0.0, 100, 2, 0, 0)] * 3)
    fleet = SimFleet(scenario, prof, build_locations(scenario), len(arrivals))
    cold = fleet.nodes[2]
    del cold.slots[0]  # the model is warm on the first two nodes only
    cold._residency_changed()
    fleet.env.process(fleet.feed(arrivals, sim_policies.make_policy("least-loaded", fleet)))
    fleet.env.run()
    # One queued request saturates a node: the third goes to the cold node, which loads the model (2 s).
    assert fleet.records.node.tolist() == [0, 1, 2]
    assert fleet.records.ttft[2] - fleet.records.rtt[2] == pytest.approx(2.0 + SERVICE_S)


def test_cached_node_states_decide_as_fresh_ones(three_locations, monkeypatch):
    # The fast path (a node's NodeState rebuilt only when it changed, RTTs by code from a dict) against the
    # plain one (a fresh NodeState per node per request, RTTs from the matrix): the same report.
    scenario = replace(three_locations(4), policies=("router", "nearest"))
    fast = deterministic(all_metrics(simulate(scenario)))
    monkeypatch.setattr(SimFleet, "node_state", SimFleet.fresh_state)
    monkeypatch.setattr(SimFleet, "rtt_by_code", lambda self, a, b: self._rtt[self._index[a]][self._index[b]])
    assert deterministic(all_metrics(simulate(scenario))) == fast

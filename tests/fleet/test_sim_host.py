"""Nodes on one host's shared cores (sim_host): processor sharing by itself, and through the fleet."""

from __future__ import annotations

import json

import pytest
import simpy
from helpers.fleet_sim import arrivals_of, one_location, write_profile

from edgeinfer.fleet import sim_policies
from edgeinfer.fleet.sim_fleet import SimFleet
from edgeinfer.fleet.sim_host import HostSpec, SharedHost
from edgeinfer.fleet.sim_profile import parse_profile
from edgeinfer.fleet.sim_run import build_locations
from edgeinfer.fleet.sim_scenario import parse_scenario


def _finish_times(spec: HostSpec, jobs: list[tuple[float, float]], shorten=None) -> list[float]:
    """Each job (start s, work s) on a host; `shorten` = (index, at s, new work s) cuts one short."""
    env = simpy.Environment()
    host = SharedHost(env, spec)
    ends = [0.0] * len(jobs)
    started = {}

    def one(i: int, start: float, work: float):
        yield env.timeout(start)
        started[i] = job = host.run(work)
        yield job.event
        ends[i] = env.now

    for i, (start, work) in enumerate(jobs):
        env.process(one(i, start, work))
    if shorten is not None:
        index, at, work = shorten

        def cut():
            yield env.timeout(at)
            host.shorten(started[index], work)

        env.process(cut())
    env.run()
    return ends


def test_jobs_share_the_cores():
    assert _finish_times(HostSpec(cores=1), [(0, 1), (0, 1)]) == pytest.approx([2, 2])
    assert _finish_times(HostSpec(cores=2), [(0, 1), (0, 1)]) == pytest.approx([1, 1])
    # three jobs on two cores advance at 2/3 each
    assert _finish_times(HostSpec(cores=2), [(0, 1)] * 3) == pytest.approx([1.5] * 3)
    # alone for 0.5 s, then half speed: the first has 0.5 s left (1 s of time), the second then runs alone
    assert _finish_times(HostSpec(cores=1), [(0, 1), (0.5, 1)]) == pytest.approx([1.5, 2.0])
    # background work that never ends leaves one of two cores
    assert _finish_times(HostSpec(cores=2, idle_cores=1), [(0, 1), (0, 1)]) == pytest.approx([2, 2])


def test_a_shortened_job_ends_when_its_new_work_is_done():
    # 10 s of work cut to 1.5 s at t = 1, sharing one core with a 2 s job from t = 0: at t = 1 each has
    # done 0.5 s; the cut one needs 1 s more at half speed (t = 3), then the other its last 0.5 s alone.
    assert _finish_times(HostSpec(cores=1), [(0, 10), (0, 2)], shorten=(0, 1.0, 1.5)) == pytest.approx(
        [3, 3.5]
    )


def test_a_host_needs_more_cores_than_its_idle_load():
    with pytest.raises(ValueError, match="must exceed idle_cores"):
        SharedHost(simpy.Environment(), HostSpec(cores=1, idle_cores=1))


def _two_nodes(tmp_path, host: dict, rows) -> SimFleet:
    # Prefill 50 ms a request (profile default), one output token: each request is one 50 ms job.
    raw = one_location(tmp_path, 1.0, 100.0, per_location=[2])
    raw["host"] = host
    write_profile(tmp_path / "p.json")
    scenario = parse_scenario(raw, base_dir=tmp_path)
    prof = parse_profile(json.loads((tmp_path / "p.json").read_text()))
    arrivals = arrivals_of(rows)
    fleet = SimFleet(scenario, prof, build_locations(scenario), len(arrivals))
    fleet.env.process(fleet.feed(arrivals, sim_policies.make_policy("least-loaded", fleet)))
    fleet.env.run()
    return fleet


@pytest.mark.parametrize("cores,ttft", [(0, 0.05), (2, 0.05), (1, 0.10)])
def test_nodes_on_one_host_slow_each_other_down(tmp_path, cores, ttft):
    # Two requests at once go to the two nodes; with a processor each, or two cores, both prefills take
    # 50 ms; on one shared core both take twice that.
    fleet = _two_nodes(tmp_path, {"cores": cores}, [(0.0, 16, 1, 0, 0)] * 2)
    assert sorted(fleet.records.node.tolist()) == [0, 1]
    assert fleet.records.ttft.tolist() == pytest.approx([ttft, ttft])


def test_routers_and_clients_work_takes_a_share_of_the_host(tmp_path):
    # One request: its 50 ms prefill shares the single core with the 50 ms the router and client spend on
    # it, and then with 10 ms for its streamed token (after the prefill, so it does not delay it).
    fleet = _two_nodes(
        tmp_path, {"cores": 1, "request_cpu_ms": 50.0, "token_cpu_ms": 10.0}, [(0.0, 16, 1, 0, 0)]
    )
    assert fleet.records.ttft[0] == pytest.approx(0.10)
    assert fleet.cpu.busy_core_s == pytest.approx(0.11)

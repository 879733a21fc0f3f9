"""The CPU a simulated node's work runs on: its own (an accelerator per node), or cores shared by a host.

A node's work (request overheads, prefills, decode steps) is one thread's: the node's GIL serialises its
event loop and engine. By default each node has a processor of its own (`Dedicated`), so work of `w`
seconds takes `w` seconds. A scenario's `[host]` puts every node on one machine of `cores` cores (as
`edgeinfer fleet up` runs a whole fleet on one box): then the nodes' work, and the work the routers and
the load generator do per request and per streamed token, share those cores. When more jobs are runnable
than there are cores, each advances at `cores / runnable` (processor sharing: what the OS's time slices
average out to); `idle_cores` are taken by work that does not scale with requests (status heartbeats,
NATS) and never free up.
"""

from __future__ import annotations

from dataclasses import dataclass

import simpy

_EPS_S = 1e-12  # float slack when a job's work is reached


@dataclass(frozen=True)
class HostSpec:
    """`[host]` of a scenario; `cores = 0` (the default) gives every node a processor of its own."""

    cores: float = 0.0
    idle_cores: float = 0.0  # taken by background work whatever the load
    request_cpu_ms: float = 0.0  # per request, outside the nodes (router, client)
    token_cpu_ms: float = 0.0  # per streamed token, outside the nodes (the router's relay, the client)


class Job:
    """`work` seconds of one thread's computation; `event` fires when it is done."""

    __slots__ = ("done", "event", "start", "work")

    def __init__(self, work: float, event: simpy.Event, start: float) -> None:
        self.work, self.event, self.start = work, event, start
        self.done = 0.0


class Dedicated:
    """A processor of the node's own: work runs at full speed, whatever else happens."""

    def __init__(self, env: simpy.Environment) -> None:
        self.env = env

    def run(self, work: float) -> Job:
        return Job(work, self.env.timeout(work), self.env.now)

    def progress(self, job: Job) -> float:
        return self.env.now - job.start

    def shorten(self, job: Job, work: float) -> None:
        """End `job` after `work` seconds of it instead (not before now)."""
        job.work = work
        job.event = self.env.timeout(max(0.0, job.start + work - self.env.now))

    def background(self, requests: int = 0, tokens: int = 0) -> None:
        """Work outside the nodes: none competes for a node's own processor."""


class SharedHost:
    """`spec.cores` cores shared by every job, as processor sharing (module docstring)."""

    def __init__(self, env: simpy.Environment, spec: HostSpec) -> None:
        if spec.cores <= spec.idle_cores:
            raise ValueError(f"[host]: cores ({spec.cores}) must exceed idle_cores ({spec.idle_cores})")
        self.env, self.spec = env, spec
        self.cores = spec.cores - spec.idle_cores
        self.jobs: list[Job] = []
        self.busy_core_s = 0.0  # core-seconds of work done, for utilisation
        self._last = env.now
        self._generation = 0  # a scheduled wake-up is stale once the set of jobs has changed

    def run(self, work: float) -> Job:
        self._advance()
        job = Job(work, self.env.event(), self.env.now)
        self.jobs.append(job)
        self._reschedule()
        return job

    def progress(self, job: Job) -> float:
        self._advance()
        return job.done

    def shorten(self, job: Job, work: float) -> None:
        self._advance()
        job.work = work
        self._reschedule()

    def background(self, requests: int = 0, tokens: int = 0) -> None:
        """Jobs for the routers' and the client's work on `requests` requests and `tokens` streamed tokens."""
        work = (requests * self.spec.request_cpu_ms + tokens * self.spec.token_cpu_ms) / 1000
        if work > 0:
            self.run(work)

    def _rate(self) -> float:
        return min(1.0, self.cores / len(self.jobs))

    def _advance(self) -> None:
        elapsed = self.env.now - self._last
        self._last = self.env.now
        if elapsed <= 0 or not self.jobs:
            return
        step = elapsed * self._rate()
        for job in self.jobs:
            job.done += step
        self.busy_core_s += step * len(self.jobs)

    def _reschedule(self) -> None:
        """Finish the jobs whose work is done; wake up when the next one will be."""
        finished = [j for j in self.jobs if j.done >= j.work - _EPS_S]
        if finished:
            self.jobs = [j for j in self.jobs if j.done < j.work - _EPS_S]
            for job in finished:
                if not job.event.triggered:
                    job.event.succeed()
        self._generation += 1
        if not self.jobs:
            return
        generation = self._generation
        delay = min(j.work - j.done for j in self.jobs) / self._rate()
        self.env.timeout(delay).callbacks.append(lambda _: self._wake(generation))

    def _wake(self, generation: int) -> None:
        if generation == self._generation:
            self._advance()
            self._reschedule()


def make_cpu(env: simpy.Environment, spec: HostSpec) -> Dedicated | SharedHost:
    return SharedHost(env, spec) if spec.cores > 0 else Dedicated(env)

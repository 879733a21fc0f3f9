"""An upstream engine's load, read from its own Prometheus `/metrics` (polled in the background).

Each engine names its gauges its own way (from their sources): vLLM `vllm:num_requests_running`,
`vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc` (`vllm:gpu_cache_usage_perc` before v1); SGLang
`sglang:num_running_reqs`, `sglang:num_queue_reqs`, `sglang:token_usage`; llama.cpp's llama-server (with
`--metrics`) `llamacpp:requests_processing`, `llamacpp:requests_deferred` (no KV gauge); another edgeinfer
node `edgeinfer:num_requests_*`. Without `/metrics`, llama-server's `/slots` still gives the busy slots.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client.parser import text_string_to_metric_families

from edgeinfer.pool.member import MemberStats

if TYPE_CHECKING:  # imported where used, as in upstream.py
    import httpx

logger = logging.getLogger("edgeinfer.pool")
# A stats read never waits as long as a generation may (the member's client allows minutes).
POLL_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class MetricNames:
    running: str
    waiting: str
    kv_usage: tuple[str, ...] = ()


ENGINES = {
    "vllm": MetricNames(
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    ),
    "sglang": MetricNames("sglang:num_running_reqs", "sglang:num_queue_reqs", ("sglang:token_usage",)),
    "llamacpp": MetricNames("llamacpp:requests_processing", "llamacpp:requests_deferred"),
    "edgeinfer": MetricNames(
        "edgeinfer:num_requests_running", "edgeinfer:num_requests_waiting", ("edgeinfer:kv_cache_usage_perc",)
    ),
}
_MODEL_LABELS = ("model", "model_name")


def parse_metrics(text: str, served_model: str) -> MemberStats | None:
    """The load in a Prometheus exposition, or None when it has no engine gauges we know. Series labelled
    with a model count only for `served_model` (an upstream may serve several)."""
    values: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            model = next((sample.labels[k] for k in _MODEL_LABELS if k in sample.labels), served_model)
            if model == served_model:
                values.setdefault(sample.name, []).append(sample.value)
    for names in ENGINES.values():
        if names.running in values and names.waiting in values:
            usage = next((max(values[n]) for n in names.kv_usage if n in values), None)
            return MemberStats(int(sum(values[names.running])), int(sum(values[names.waiting])), usage)
    return None


def parse_slots(slots: Iterable[dict]) -> MemberStats:
    """llama-server's `/slots`: busy slots run, the slot count is its seats; its queue is not shown."""
    slots = list(slots)
    return MemberStats(sum(bool(s.get("is_processing")) for s in slots), 0, seats=len(slots))


class StatsPoller:
    """Keeps the latest stats of one upstream, refreshed every `interval_s` by a background task."""

    def __init__(self, client: httpx.AsyncClient, served_model: str, interval_s: float) -> None:
        self._client = client
        self._served = served_model
        self._interval_s = interval_s
        self.latest: MemberStats | None = None
        self.error: str | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name=f"upstream-stats-{self._served}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _loop(self) -> None:
        while True:
            await self.poll()
            await asyncio.sleep(self._interval_s)

    async def poll(self) -> None:
        import httpx

        try:
            self.latest = await self._read()
            self.error = None
        except (httpx.HTTPError, ValueError) as exc:  # unreachable, or an answer we cannot read
            if self.error is None:  # once per outage, not at every poll
                logger.warning("upstream %s: reading its stats failed: %r", self._served, exc)
            self.latest, self.error = None, f"stats unavailable: {exc!r}"

    async def _read(self) -> MemberStats | None:
        response = await self._client.get("/metrics", timeout=POLL_TIMEOUT_S)
        if response.status_code < 400:
            stats = parse_metrics(response.text, self._served)
            if stats is not None:
                return stats
        response = await self._client.get("/slots", timeout=POLL_TIMEOUT_S)
        if response.status_code < 400 and isinstance(slots := response.json(), list):
            return parse_slots(slots)
        return None  # an upstream that shows no load: only what the node sends it counts

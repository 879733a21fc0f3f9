"""Client-side helpers for the router tests: requests, long streams, metrics, waiting, publishing."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
from helpers.router_fleet import KEYS, RouterThread

from edgeinfer.types.status import NodeStatus

ALICE = {"authorization": f"Bearer {KEYS['alice']}"}


def ask(
    url: str, model: str = "tiny", location: str | None = None, affinity: str | None = None, **body: Any
) -> httpx.Response:
    headers = dict(ALICE)
    if location:
        headers["x-client-location"] = location
    if affinity:
        headers["x-session-affinity"] = affinity
    payload = {"model": model, "prompt": "Hello", "max_tokens": 4, **body}
    return httpx.post(url + "/v1/completions", json=payload, headers=headers, timeout=60)


def served_by(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return response.headers["x-edgeinfer-node"]


@contextmanager
def long_streams(url: str, count: int, model: str) -> Iterator[None]:
    """`count` long generations streamed from `url` in threads, closed (aborted) on exit."""
    stop = threading.Event()
    body = {"model": model, "prompt": "Hello", "max_tokens": 3500, "ignore_eos": True, "stream": True}

    def run() -> None:
        with (
            httpx.Client(timeout=120) as client,
            client.stream("POST", url + "/v1/completions", json=body, headers=ALICE) as response,
        ):
            for _ in response.iter_raw():
                if stop.is_set():
                    return

    threads = [threading.Thread(target=run, daemon=True) for _ in range(count)]
    for t in threads:
        t.start()
    try:
        yield
    finally:
        stop.set()
        for t in threads:
            t.join(60)


def node_status(router: RouterThread, node_id: str) -> NodeStatus:
    status = router.service.state.nodes[node_id].status
    assert status is not None
    return status


def wait_until(condition: Any, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def metric(url: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        named = line.startswith(name + "{") or line.startswith(name + " ")
        if named and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


@contextmanager
def publishing(nats_url: str, status: NodeStatus) -> Iterator[None]:
    """Publish `status` (freshly stamped) at 10 Hz from a thread until the block ends."""
    import nats

    stop = threading.Event()

    async def loop() -> None:
        nc = await nats.connect(nats_url)
        while not stop.is_set():
            fresh = dataclasses.replace(status, ts=time.time())
            await nc.publish(f"edgeinfer.status.{status.node_id}", fresh.to_json())
            await asyncio.sleep(0.1)
        await nc.close()

    thread = threading.Thread(target=asyncio.run, args=(loop(),), daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(10)

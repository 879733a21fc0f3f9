"""Every router of a fleet must hold the same tenants file (the same keys, limits and prices): each puts
its file's digest in the routers bucket under its own id and compares it with the others', at start and
then periodically, so a router that differs is reported on every router, in the log and on /metrics."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
from typing import Any

from nats.js.errors import NoKeysError

from edgeinfer.router.limits.store import ROUTERS_BUCKET, open_bucket

logger = logging.getLogger("edgeinfer.router")


def tenants_digest(table: dict[str, Any] | None) -> str:
    """The digest of a parsed tenants file (None: no file, an open router): formatting aside, two files
    that define the same tenants have the same digest."""
    canonical = json.dumps(table, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


class TenantsCheck:
    def __init__(self, js: Any, router_id: str, digest: str, metrics: Any, interval_s: float = 10.0) -> None:
        self._js = js
        self._router_id = router_id
        self._digest = digest
        self._metrics = metrics
        self._interval_s = interval_s
        self._kv: Any = None
        self._reported: frozenset[str] = frozenset()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> list[str]:
        """Put this router's digest and compare; returns the routers whose file differs."""
        self._kv = await open_bucket(self._js, ROUTERS_BUCKET, 3 * self._interval_s)
        differing = await self.check()
        self._task = asyncio.create_task(self._loop(), name="tenants-check")
        return differing

    async def check(self) -> list[str]:
        await self._kv.put(f"tenants.{self._router_id}", self._digest.encode())
        try:  # every key: nats-py's filtered listing finds none on some servers
            keys = [k for k in await self._kv.keys() if k.startswith("tenants.")]
        except NoKeysError:
            keys = []
        differing = []
        for key in keys:
            with contextlib.suppress(Exception):  # a key that aged out between the listing and the read
                if (await self._kv.get(key)).value.decode() != self._digest:
                    differing.append(key.removeprefix("tenants."))
        self._report(frozenset(differing))
        return sorted(differing)

    def _report(self, differing: frozenset[str]) -> None:
        self._metrics.tenants_mismatch.set(1 if differing else 0)
        if differing and differing != self._reported:
            logger.error(
                "the tenants file differs between routers: %s hold another one than this router (%s); "
                "limits and keys then differ by router",
                ", ".join(sorted(differing)),
                self._router_id,
            )
        self._reported = differing

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            try:
                await self.check()
            except Exception as exc:  # NATS out: the limiter reports the outage; try again later
                logger.debug("tenants check: %s", exc)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

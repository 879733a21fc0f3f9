"""This node's view of the tenants' uploaded finetunes: on the fleet's JetStream store when the node is on
NATS (connected on first use, so a node that never sees a finetune never loads nats-py), else in a
directory of its own. A request naming a finetune finds it here; its files are copied to the cache
directory once per revision, where the engine registers them like any adapter directory."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

from edgeinfer.api.adapters import TenantAdapter
from edgeinfer.api.errors import unavailable
from edgeinfer.finetunes.store import FinetuneStore, JetStreamFinetunes, LocalFinetunes

logger = logging.getLogger("edgeinfer.node")

# A finetune found (or found missing) is trusted this long before the store is asked again: an upload
# through another node or router is seen here within it.
LOOKUP_TTL_S = 2.0
CONNECT_TIMEOUT_S = 5.0


class NodeFinetunes:
    def __init__(self, nats_url: str | None, directory: Path, cache: Path, node_id: str) -> None:
        self._nats_url = nats_url
        self._directory = directory
        self._cache = cache
        self._node_id = node_id
        self._store: FinetuneStore | None = None
        self._connection: Any = None
        self._lock = asyncio.Lock()
        self._found: dict[tuple[str, str], tuple[float, TenantAdapter | None]] = {}

    async def store(self) -> FinetuneStore:
        """The store, opened on first use (503 while NATS cannot be reached)."""
        if self._store is not None:
            return self._store
        async with self._lock:
            if self._store is None:
                self._store = await self._open()
        return self._store

    async def _open(self) -> FinetuneStore:
        if not self._nats_url:
            return LocalFinetunes(self._directory)
        import nats

        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                nc = await nats.connect(
                    self._nats_url,
                    name=f"edgeinfer-node-{self._node_id}-finetunes",
                    max_reconnect_attempts=-1,
                )
        except Exception as exc:
            raise unavailable(f"the fleet's finetunes are not reachable (NATS): {exc}") from None
        self._connection = nc
        return await JetStreamFinetunes(nc.jetstream()).open()

    async def adapter(self, tenant: str, name: str) -> TenantAdapter | None:
        """The tenant's complete finetune of that name or id as an adapter directory on this machine
        (None: no such finetune of this tenant, or its files are not all uploaded)."""
        key = (tenant, name)
        cached = self._found.get(key)
        if cached is not None and cached[0] > time.monotonic():
            return cached[1]
        store = await self.store()
        finetune = await store.find(tenant, name)
        adapter = None
        if finetune is not None and finetune.complete:
            directory = await store.materialize(finetune, self._cache)
            adapter = TenantAdapter(finetune.name, finetune.model, str(directory), finetune.revision)
        self._found[key] = (time.monotonic() + LOOKUP_TTL_S, adapter)
        return adapter

    def forget(self, tenant: str) -> None:
        """Drop what was found for a tenant (after its upload here: the next request sees it at once)."""
        self._found = {k: v for k, v in self._found.items() if k[0] != tenant}

    async def close(self) -> None:
        if self._connection is not None:
            await self._connection.close()

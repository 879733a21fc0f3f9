"""Tenants' LoRA adapters on this node: which base and adapter a request names, whether the tenant owns it,
and registering it on the base's engine the first time it is used there (the engine checks the weights)."""

from __future__ import annotations

import asyncio

from edgeinfer.api.adapters import no_such_adapter, split_model
from edgeinfer.api.errors import bad_request
from edgeinfer.api.jobs import Job
from edgeinfer.api.tenants import Tenant
from edgeinfer.pool.manager import ModelPool, UnknownModelError
from edgeinfer.pool.member import LocalMember, PoolMember


class NodeAdapters:
    def __init__(self, pool: ModelPool) -> None:
        self._pool = pool
        self._lock = asyncio.Lock()  # one registration at a time: two would race to replace the name

    def base_model(self, job: Job, tenant: Tenant) -> str:
        """The canonical base model of the job (UnknownModelError for an unknown one); with an adapter
        (`model: "base:adapter"` or Workers AI's `lora`), leaves the adapter's name in `job.adapter` and
        answers 404, as for one that does not exist, where the tenant has no such adapter of that base."""
        name = job.model
        if job.adapter is None:
            base, adapter = split_model(name)
            if adapter is None or self._known(name):  # a model whose own name holds ':' stays whole
                return self._pool.resolve(name)
            name, job.adapter = base, adapter
        model = self._pool.resolve(name)
        owned = tenant.adapters.get(job.adapter)
        if owned is None or not self._known(owned.model) or self._pool.resolve(owned.model) != model:
            raise no_such_adapter(name, job.adapter)
        return model

    async def ensure(self, member: PoolMember, tenant: Tenant, job: Job) -> None:
        """Register the job's adapter on the member's engine unless it is there (400 if it cannot be
        served on this base: rank, targets, shapes, size)."""
        if job.adapter is None:
            return
        if not isinstance(member, LocalMember):
            raise bad_request("LoRA adapters are served by this node's own engines only", "model")
        adapter = tenant.adapters[job.adapter]
        name = adapter.engine_name(tenant.name)
        async with self._lock:
            if member.engine.has_adapter(name):
                return
            try:
                await member.engine.load_adapter(name, adapter.path)
            except ValueError as e:
                raise bad_request(
                    f"adapter {adapter.name!r} cannot be served on {member.name}: {e}", "model"
                ) from None

    def _known(self, name: str) -> bool:
        try:
            self._pool.resolve(name)
        except UnknownModelError:
            return False
        return True

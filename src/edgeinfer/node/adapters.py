"""Tenants' LoRA adapters on this node: which base and adapter a request names, whether the tenant owns it
(declared in the tenants file, or uploaded as a finetune), and registering it on the base's engine the first
time it is used there (the engine checks the weights)."""

from __future__ import annotations

import asyncio
import dataclasses

from edgeinfer.api.adapters import TenantAdapter, adapter_key, no_such_adapter, split_model
from edgeinfer.api.errors import bad_request
from edgeinfer.api.jobs import Job
from edgeinfer.api.tenants import Tenant
from edgeinfer.node.finetunes import NodeFinetunes
from edgeinfer.pool.manager import ModelPool, UnknownModelError
from edgeinfer.pool.member import LocalMember, PoolMember


class NodeAdapters:
    def __init__(self, pool: ModelPool, finetunes: NodeFinetunes) -> None:
        self._pool = pool
        self.finetunes = finetunes
        self._lock = asyncio.Lock()  # one registration at a time: two would race to replace the name
        self._keys: dict[str, str] = {}  # engine name -> the adapter's key (api/adapters.adapter_key)

    async def target(self, job: Job, tenant: Tenant) -> tuple[str, Tenant]:
        """The canonical base model of the job (UnknownModelError for an unknown one); with an adapter
        (`model: "base:adapter"` or Workers AI's `lora`), leaves the adapter's name in `job.adapter` and
        answers 404, as for one that does not exist, where the tenant has no such adapter of that base.
        The tenant comes back holding the adapter among its own where it is an uploaded finetune."""
        name = job.model
        if job.adapter is None:
            base, adapter = split_model(name)
            if adapter is None or self._known(name):  # a model whose own name holds ':' stays whole
                return self._pool.resolve(name), tenant
            name, job.adapter = base, adapter
        model = self._pool.resolve(name)
        owned = tenant.adapters.get(job.adapter)
        if owned is None and (owned := await self.finetunes.adapter(tenant.name, job.adapter)):
            job.adapter = owned.name  # named by its id, it is metered under its name all the same
            tenant = dataclasses.replace(tenant, adapters={**tenant.adapters, owned.name: owned})
        if owned is None or not self._known(owned.model) or self._pool.resolve(owned.model) != model:
            raise no_such_adapter(name, job.adapter)
        return model, tenant

    async def ensure(self, member: PoolMember, tenant: Tenant, job: Job) -> None:
        """Register the job's adapter on the member's engine unless it is there (400 if it cannot be
        served on this base: rank, targets, shapes, size)."""
        if job.adapter is None:
            return
        if not isinstance(member, LocalMember):
            raise bad_request("LoRA adapters are served by this node's own engines only", "model")
        adapter = tenant.adapters[job.adapter]
        await self._register(member, tenant.name, adapter)

    async def _register(self, member: LocalMember, tenant: str, adapter: TenantAdapter) -> None:
        name = adapter.engine_name(tenant)
        self._keys[name] = adapter_key(tenant, adapter.name)
        async with self._lock:
            if member.engine.has_adapter(name):
                return
            try:
                await member.engine.load_adapter(name, adapter.path)
            except ValueError as e:
                raise bad_request(
                    f"adapter {adapter.name!r} cannot be served on {member.name}: {e}", "model"
                ) from None

    async def register_now(self, tenant: Tenant, name: str) -> None:
        """Register the tenant's finetune on its base's engine if that is loaded here (400 if the base
        cannot take it); a base not loaded here checks it when it first serves it."""
        adapter = await self.finetunes.adapter(tenant.name, name)
        if adapter is None or not self._known(adapter.model):
            return
        member = self._pool.residents().get(self._pool.resolve(adapter.model))
        if isinstance(member, LocalMember):
            await self._register(member, tenant.name, adapter)

    def warm(self) -> tuple[str, ...]:
        """The adapters some engine here holds loaded, by key: routers send their requests here first."""
        keys = {
            self._keys[name]
            for member in self._pool.residents().values()
            if isinstance(member, LocalMember)
            for name in member.engine.resident_adapters()
            if name in self._keys
        }
        return tuple(sorted(keys))

    def _known(self, name: str) -> bool:
        try:
            self._pool.resolve(name)
        except UnknownModelError:
            return False
        return True

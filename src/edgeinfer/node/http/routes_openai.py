"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions, /v1/models, /v1/usage."""

from __future__ import annotations

import time
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response

from edgeinfer.api.adapters import TenantAdapter
from edgeinfer.api.errors import ApiError
from edgeinfer.api.http.json_body import BoundedJSONRoute
from edgeinfer.api.prepare import chat_job, completion_job
from edgeinfer.api.schemas import ChatCompletionRequest, CompletionRequest
from edgeinfer.api.tenants import Tenant
from edgeinfer.node.http.auth import AuthTenant
from edgeinfer.node.http.render import ChatRenderer, CompletionRenderer

router = APIRouter(route_class=BoundedJSONRoute)
_STARTED = int(time.time())


@router.post("/v1/completions", tags=["openai"])
async def completions(body: CompletionRequest, request: Request, tenant: AuthTenant) -> Response:
    service = request.app.state.service
    job = completion_job(body, await request.json(), service.limits)
    return await service.execute(request, tenant, job, CompletionRenderer)


@router.post("/v1/chat/completions", tags=["openai"])
async def chat_completions(body: ChatCompletionRequest, request: Request, tenant: AuthTenant) -> Response:
    service = request.app.state.service
    job = chat_job(body, await request.json(), service.limits)
    return await service.execute(request, tenant, job, ChatRenderer)


@router.get("/v1/models", tags=["openai"])
async def models(request: Request, tenant: AuthTenant) -> dict[str, Any]:
    """Every model and alias this node serves, with its residency in the pool, and the caller's own LoRA
    adapters as `base:adapter` (no other tenant's)."""
    pool = request.app.state.service.pool
    data = []
    for state in pool.states():
        info = {
            "kind": state.kind,
            "state": state.state,
            "memory_bytes": state.memory_bytes,
            "pinned": state.pinned,
            "version": state.version,
        }
        for name in (state.name, *state.aliases):
            data.append(
                {
                    "id": name,
                    "object": "model",
                    "created": _STARTED,
                    "owned_by": "edgeinfer",
                    "root": state.name,
                    "parent": None if name == state.name else state.name,
                    "edgeinfer": info,
                }
            )
    for adapter in [*tenant.adapters.values(), *await _finetunes(request, tenant)]:
        data.append(
            {
                "id": f"{adapter.model}:{adapter.name}",
                "object": "model",
                "created": _STARTED,
                "owned_by": tenant.name,
                "root": adapter.model,
                "parent": adapter.model,
                "edgeinfer": {"kind": "lora"},
            }
        )
    return {"object": "list", "data": data}


@router.get("/v1/usage", tags=["edgeinfer"])
async def usage(
    request: Request,
    tenant: AuthTenant,
    start: Annotated[float | None, Query(description="unix seconds, inclusive", allow_inf_nan=False)] = None,
    end: Annotated[float | None, Query(description="unix seconds, exclusive", allow_inf_nan=False)] = None,
) -> dict[str, Any]:
    """The calling tenant's metered usage per model: requests, input, cached input and output tokens, cost."""
    return await request.app.state.service.usage(tenant, start, end)


async def _finetunes(request: Request, tenant: Tenant) -> list[TenantAdapter]:
    """The tenant's uploaded finetunes whose files are all in (none while the fleet's store is out of
    reach: the models themselves are still listed)."""
    try:
        store = await request.app.state.service.adapters.finetunes.store()
        finetunes = await store.list(tenant.name)
    except ApiError:
        return []
    return [TenantAdapter(f.name, f.model, "") for f in finetunes if f.complete]

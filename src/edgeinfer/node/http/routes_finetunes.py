"""Workers AI's finetunes API: a tenant creates a finetune for a base model, uploads its two PEFT files as
assets, then names it in requests (`lora`, or `model: "base:name"`).

    POST /accounts/{account_id}/ai/finetunes                                {"model", "name", "description"}
    GET  /accounts/{account_id}/ai/finetunes
    POST /accounts/{account_id}/ai/finetunes/{finetune_id}/finetune-assets    multipart: file, file_name

A finetune belongs to the tenant whose key created it: another tenant's id or name is a 404. Once both files
are in, a node that has the base model loaded registers the adapter at once, so an adapter its base cannot
take (rank, target modules, shapes) is a 400 to the upload that completed it, not to a later request.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from edgeinfer.api.errors import bad_request
from edgeinfer.api.http.json_body import BoundedJSONRoute
from edgeinfer.finetunes import answers
from edgeinfer.finetunes.upload import read_upload
from edgeinfer.node.http.auth import AuthTenant
from edgeinfer.node.service import NodeService
from edgeinfer.pool.member import EMBED
from edgeinfer.types import bounded_json

router = APIRouter(route_class=BoundedJSONRoute)


@router.get("/accounts/{account_id}/ai/finetunes", tags=["workers-ai"])
async def list_finetunes(account_id: str, request: Request, tenant: AuthTenant) -> dict[str, Any]:
    """The calling account's finetunes. The account id is accepted for compatibility."""
    service: NodeService = request.app.state.service
    return await answers.listing(await service.adapters.finetunes.store(), tenant.name)


@router.post("/accounts/{account_id}/ai/finetunes", tags=["workers-ai"])
async def create_finetune(account_id: str, request: Request, tenant: AuthTenant) -> dict[str, Any]:
    """Create a finetune from `{"model", "name", "description"}`; its files follow as assets."""
    service: NodeService = request.app.state.service

    def base_model(name: str) -> str:
        """The canonical name of a text-generation model (404 unknown, 400 an embedding model)."""
        model = service.resolve(name)
        if service.model_task(model) == EMBED:
            raise bad_request(f"{model} is an embedding model: finetunes are for text generation", "model")
        return model

    try:
        value = bounded_json.loads(await request.body())
    except ValueError as exc:
        raise bad_request(f"invalid JSON body: {exc}") from None
    return await answers.create(await service.adapters.finetunes.store(), tenant.name, value, base_model)


@router.post("/accounts/{account_id}/ai/finetunes/{finetune_id}/finetune-assets", tags=["workers-ai"])
async def upload_asset(
    account_id: str, finetune_id: str, request: Request, tenant: AuthTenant
) -> dict[str, Any]:
    """Upload `adapter_config.json` or `adapter_model.safetensors` (multipart `file` and `file_name`)."""
    service: NodeService = request.app.state.service
    file_name, data = read_upload(request.headers.get("content-type"), await request.body())
    finetunes = service.adapters.finetunes
    store = await finetunes.store()
    answer, finetune = await answers.upload(store, tenant.name, finetune_id, file_name, data)
    finetunes.forget(tenant.name)
    if finetune.complete:
        await service.adapters.register_now(tenant, finetune.name)
    return answer

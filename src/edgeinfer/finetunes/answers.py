"""The finetunes API as nodes and routers answer it, in Workers AI's envelope: create, list, upload."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from edgeinfer.finetunes.records import Finetune, check_asset, new_finetune, not_found
from edgeinfer.finetunes.store import FinetuneStore


def envelope(result: Any) -> dict[str, Any]:
    return {"result": result, "success": True, "errors": [], "messages": []}


async def create(
    store: FinetuneStore, tenant: str, value: Any, base_model: Callable[[str], str]
) -> dict[str, Any]:
    """A new finetune of a model the fleet serves (`base_model`: the canonical name, or the API error for
    an unknown or non-generating model)."""
    finetune = new_finetune(tenant, value)
    finetune = replace(finetune, model=base_model(finetune.model))
    await store.create(finetune)
    return envelope(finetune.public())


async def listing(store: FinetuneStore, tenant: str) -> dict[str, Any]:
    return envelope([f.public() for f in await store.list(tenant)])


async def upload(
    store: FinetuneStore, tenant: str, finetune_id: str, file_name: str, data: bytes
) -> tuple[dict[str, Any], Finetune]:
    """Store one of the finetune's two files (its name or id in the path); the answer and the finetune as
    it is now."""
    finetune = await store.find(tenant, finetune_id)
    if finetune is None:
        raise not_found(finetune_id)
    check_asset(file_name, data)
    updated = await store.add_asset(finetune, file_name, data)
    result = {**updated.public(), "file_name": file_name, "complete": updated.complete}
    return envelope(result), updated

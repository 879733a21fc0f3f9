"""What the Batch API answers, in Workers AI's envelope: the queued receipt, a poll's status or results."""

from __future__ import annotations

from typing import Any

from edgeinfer.batch.store import BatchStore
from edgeinfer.batch.submission import Entry, Poll

_USAGE_FIELDS = ("prompt_tokens", "completion_tokens", "total_tokens")


def envelope(result: dict[str, Any], messages: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"result": result, "success": True, "errors": [], "messages": messages or []}


async def answer(store: BatchStore, tenant: str, model: str, read: list[Entry] | Poll) -> dict[str, Any]:
    """A Batch-API call as nodes and routers answer it: entries are queued (the receipt), a poll polled."""
    if isinstance(read, Poll):
        return await poll(store, tenant, read.request_id)
    batch = await store.submit(tenant, model, read)
    return envelope({"status": "queued", "request_id": batch.request_id, "model": batch.model})


async def poll(store: BatchStore, tenant: str, request_id: str) -> dict[str, Any]:
    """The results in order once every entry has one; until then `queued` (no node has started) or
    `running`, with how many are done, and a message while no node serves the batch's model."""
    batch = await store.batch(tenant, request_id)
    done, running = await store.progress(batch)
    if done >= batch.count:
        responses = await store.results(batch)
        return envelope({"responses": responses, "usage": _total_usage(responses)})
    status = {
        "status": "running" if running else "queued",
        "request_id": batch.request_id,
        "model": batch.model,
        "completed": done,
        "total": batch.count,
    }
    messages = []
    if not await store.serving(batch.model):
        text = f"no node serves model {batch.model} now; the batch stays queued until one does"
        messages.append({"code": "no_node_serves_model", "message": text})
    return envelope(status, messages)


def _total_usage(responses: list[dict[str, Any]]) -> dict[str, int]:
    total = dict.fromkeys(_USAGE_FIELDS, 0)
    for response in responses:
        usage = (response.get("result") or {}).get("usage") or {}
        for name in _USAGE_FIELDS:
            total[name] += int(usage.get(name, 0))
    return total

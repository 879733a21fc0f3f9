"""Workers-AI compatible route: POST /accounts/{account_id}/ai/run/{model} (model names may hold slashes).

The model decides the task: text generation (`prompt` or `messages`) or text embeddings (`text`). With
`?queueRequest=true` it is the Batch API: `{"requests": [...]}` is queued (answered with a `request_id` at
once) and `{"request_id": ...}` polls for its results; that needs the node on NATS (`--nats-url`).
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response

from edgeinfer.api.embeddings import workers_ai_embedding_job
from edgeinfer.api.errors import STATUS_CLIENT_CLOSED, bad_request
from edgeinfer.api.http.json_body import BoundedJSONRoute
from edgeinfer.api.prepare import check_one_workers_ai_input, workers_ai_job
from edgeinfer.api.schemas import WorkersAIRunRequest
from edgeinfer.batch import answers
from edgeinfer.batch.submission import read_batch_body
from edgeinfer.node.http.auth import AuthTenant
from edgeinfer.node.http.render import WorkersAIRenderer
from edgeinfer.node.http.vectors import VectorsResponse, workers_ai_body
from edgeinfer.pool.member import EMBED

router = APIRouter(route_class=BoundedJSONRoute)


@router.post("/accounts/{account_id}/ai/run/{model:path}", tags=["workers-ai"])
async def run_model(
    account_id: str,
    model: str,
    body: WorkersAIRunRequest,
    request: Request,
    tenant: AuthTenant,
    queue_request: Annotated[bool, Query(alias="queueRequest")] = False,
) -> Response:
    """Run a model. The account id is accepted for compatibility; the API key decides the tenant."""
    service = request.app.state.service
    if queue_request:
        return JSONResponse(await _queued(model, await request.json(), request, tenant))
    check_one_workers_ai_input(body)
    if service.model_task(model) == EMBED:
        return await _embed(model, body, request, tenant)
    job = workers_ai_job(model, body, await request.json(), service.limits)
    return await service.execute(request, tenant, job, WorkersAIRenderer)


async def _queued(model: str, value: Any, request: Request, tenant: AuthTenant) -> dict[str, Any]:
    """The Batch API: submit (entries checked whole first) or poll."""
    service, batch = request.app.state.service, request.app.state.batch
    if batch is None:
        message = "queueRequest needs the batch queue: start the node with --nats-url"
        raise bad_request(message, "queueRequest")
    name = service.resolve(model)
    read = read_batch_body(value, name, service.limits, embeddings=service.model_task(name) == EMBED)
    return await answers.answer(batch.store(), tenant.name, name, read)


async def _embed(model: str, body: WorkersAIRunRequest, request: Request, tenant: AuthTenant) -> Response:
    service = request.app.state.service
    outcome = await service.embed(request, tenant, workers_ai_embedding_job(model, body, service.limits))
    if outcome is None:
        return Response(status_code=STATUS_CLIENT_CLOSED)
    headers = {"x-edgeinfer-timing": outcome.timing}
    return VectorsResponse(workers_ai_body(outcome.vectors), headers=headers)

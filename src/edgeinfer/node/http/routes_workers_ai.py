"""Workers-AI compatible route: POST /accounts/{account_id}/ai/run/{model} (model names may hold slashes).

The model decides the task: text generation (`prompt` or `messages`) or text embeddings (`text`).
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from edgeinfer.api.embeddings import workers_ai_embedding_job
from edgeinfer.api.errors import STATUS_CLIENT_CLOSED
from edgeinfer.api.http.json_body import BoundedJSONRoute
from edgeinfer.api.prepare import check_one_workers_ai_input, workers_ai_job
from edgeinfer.api.schemas import WorkersAIRunRequest
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
) -> Response:
    """Run a model. The account id is accepted for compatibility; the API key decides the tenant."""
    service = request.app.state.service
    check_one_workers_ai_input(body)
    if service.model_task(model) == EMBED:
        return await _embed(model, body, request, tenant)
    job = workers_ai_job(model, body, await request.json(), service.limits)
    return await service.execute(request, tenant, job, WorkersAIRenderer)


async def _embed(model: str, body: WorkersAIRunRequest, request: Request, tenant: AuthTenant) -> Response:
    service = request.app.state.service
    outcome = await service.embed(request, tenant, workers_ai_embedding_job(model, body, service.limits))
    if outcome is None:
        return Response(status_code=STATUS_CLIENT_CLOSED)
    headers = {"x-edgeinfer-timing": outcome.timing}
    return VectorsResponse(workers_ai_body(outcome.vectors), headers=headers)

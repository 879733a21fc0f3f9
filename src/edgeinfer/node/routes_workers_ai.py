"""Workers-AI compatible route: POST /accounts/{account_id}/ai/run/{model} (model names may hold slashes)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from edgeinfer.node.auth import AuthTenant
from edgeinfer.node.prepare import workers_ai_job
from edgeinfer.node.render import WorkersAIRenderer
from edgeinfer.node.schemas import WorkersAIRunRequest

router = APIRouter()


@router.post("/accounts/{account_id}/ai/run/{model:path}", tags=["workers-ai"])
async def run_model(
    account_id: str,
    model: str,
    body: WorkersAIRunRequest,
    request: Request,
    tenant: AuthTenant,
) -> Response:
    """Text generation. The account id is accepted for compatibility; the API key decides the tenant."""
    service = request.app.state.service
    job = workers_ai_job(model, body, await request.json(), service.limits)
    return await service.execute(request, tenant, job, WorkersAIRenderer)

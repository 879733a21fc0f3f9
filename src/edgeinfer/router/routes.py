"""The router's routes: the node's OpenAI and Workers-AI paths (validated the same way, so malformed
bodies get the node's 4xx here), /v1/models for the fleet, and ops routes."""

from __future__ import annotations

import time
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from edgeinfer.api.embeddings import openai_embedding_job, workers_ai_embedding_job
from edgeinfer.api.http.json_body import BoundedJSONRoute
from edgeinfer.api.jobs import Job
from edgeinfer.api.prepare import chat_job, check_one_workers_ai_input, completion_job, workers_ai_job
from edgeinfer.api.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    WorkersAIRunRequest,
)
from edgeinfer.api.tenants import Tenant
from edgeinfer.obs.metrics import CONTENT_TYPE

router = APIRouter(route_class=BoundedJSONRoute)
_bearer = HTTPBearer(auto_error=False, description="API key from the fleet's tenants file")
_STARTED = int(time.time())


async def router_tenant(
    request: Request, _: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> Tenant:
    """Before the body is validated, as on the node: a wrong key is a 401 whatever the body holds.
    `async` so that FastAPI runs it on the event loop, not in its thread pool (a thread hop per request)."""
    return request.app.state.service.tenants.authenticate(request.headers.get("authorization"))


RouterTenant = Annotated[Tenant, Depends(router_tenant)]


@router.post("/v1/completions", tags=["openai"])
async def completions(body: CompletionRequest, request: Request, tenant: RouterTenant) -> Response:
    service = request.app.state.service
    job = completion_job(body, await request.json(), service.config.limits)
    return await service.route(request, tenant, job.model, _output_tokens(job, service))


@router.post("/v1/chat/completions", tags=["openai"])
async def chat_completions(body: ChatCompletionRequest, request: Request, tenant: RouterTenant) -> Response:
    service = request.app.state.service
    job = chat_job(body, await request.json(), service.config.limits)
    return await service.route(request, tenant, job.model, _output_tokens(job, service))


@router.post("/v1/embeddings", tags=["openai"])
async def embeddings(body: EmbeddingRequest, request: Request, tenant: RouterTenant) -> Response:
    service = request.app.state.service
    job = openai_embedding_job(body, service.config.limits)
    return await service.route(request, tenant, job.model)


@router.post("/accounts/{account_id}/ai/run/{model:path}", tags=["workers-ai"])
async def run_model(
    account_id: str, model: str, body: WorkersAIRunRequest, request: Request, tenant: RouterTenant
) -> Response:
    """Validated as the node does: a model that the fleet serves for embeddings takes `text`, any other
    model the text-generation shape."""
    service = request.app.state.service
    check_one_workers_ai_input(body)
    if service.is_embedding_model(model):
        job = workers_ai_embedding_job(model, body, service.config.limits)
    else:
        job = workers_ai_job(model, body, await request.json(), service.config.limits)
        return await service.route(request, tenant, job.model, _output_tokens(job, service))
    return await service.route(request, tenant, job.model)


def _output_tokens(job: Job, service: Any) -> int:
    """The most a generation may produce, all choices together (the node's own reservation likewise)."""
    return job.num_choices * (job.max_tokens or service.config.limits.max_tokens)


@router.get("/v1/models", tags=["openai"])
async def models(request: Request, _: RouterTenant) -> dict[str, Any]:
    """Every model some live node of the fleet serves."""
    service = request.app.state.service
    names = sorted(service.state.served_models(service.config.policy.drop_after_s))
    data = [{"id": n, "object": "model", "created": _STARTED, "owned_by": "edgeinfer"} for n in names]
    return {"object": "list", "data": data}


@router.get("/health", tags=["ops"])
async def health() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/ready", tags=["ops"])
async def ready(request: Request) -> JSONResponse:
    """200 once some node has reported (the router can route something)."""
    snapshot = request.app.state.service.state.snapshot()
    ok = bool(getattr(request.app.state, "ready", False)) and bool(snapshot.nodes)
    return JSONResponse(
        {"status": "ready" if ok else "starting", "nodes": len(snapshot.nodes)}, 200 if ok else 503
    )


@router.get("/metrics", tags=["ops"])
async def metrics(request: Request) -> Response:
    return Response(request.app.state.service.metrics.render(), media_type=CONTENT_TYPE)

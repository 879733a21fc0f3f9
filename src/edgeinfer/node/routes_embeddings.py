"""OpenAI-compatible route: POST /v1/embeddings."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from edgeinfer.node.auth import AuthTenant
from edgeinfer.node.embedding_run import STATUS_CLIENT_CLOSED
from edgeinfer.node.embeddings import VectorsResponse, openai_body, openai_embedding_job
from edgeinfer.node.json_body import BoundedJSONRoute
from edgeinfer.node.schemas import EmbeddingRequest

router = APIRouter(route_class=BoundedJSONRoute)


@router.post("/v1/embeddings", tags=["openai"])
async def embeddings(body: EmbeddingRequest, request: Request, tenant: AuthTenant) -> Response:
    """Vectors for a string, a list of strings, token ids or lists of token ids (float or base64)."""
    service = request.app.state.service
    job = openai_embedding_job(body, service.limits)
    outcome = await service.embed(request, tenant, job)
    if outcome is None:
        return Response(status_code=STATUS_CLIENT_CLOSED)
    headers = {"x-edgeinfer-timing": outcome.timing}
    return VectorsResponse(openai_body(job, body.model, outcome.vectors, outcome.usage), headers=headers)

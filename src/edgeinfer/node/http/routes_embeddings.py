"""OpenAI-compatible route: POST /v1/embeddings."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from edgeinfer.api.embeddings import openai_embedding_job
from edgeinfer.api.errors import STATUS_CLIENT_CLOSED
from edgeinfer.api.http.json_body import BoundedJSONRoute
from edgeinfer.api.schemas import EmbeddingRequest
from edgeinfer.node.http.auth import AuthTenant
from edgeinfer.node.http.vectors import VectorsResponse, openai_body

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

"""Operational routes: /health (liveness), /ready (preloads done), /node/status (for routers),
/metrics (Prometheus)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from edgeinfer.node.fleet_status import node_status
from edgeinfer.obs.metrics import CONTENT_TYPE

router = APIRouter()


@router.get("/health", tags=["ops"])
async def health() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/ready", tags=["ops"])
async def ready(request: Request) -> JSONResponse:
    """503 until start-up (including --preload) finished, and again while shutting down."""
    is_ready = bool(getattr(request.app.state, "ready", False))
    pool = request.app.state.service.pool
    resident = sorted(state.name for state in pool.states() if state.state == "resident")
    body = {"status": "ready" if is_ready else "starting", "resident_models": resident}
    return JSONResponse(body, status_code=200 if is_ready else 503)


@router.get("/node/status", tags=["ops"])
async def status(request: Request) -> Response:
    """The NodeStatus routers read (the same JSON the node publishes on NATS)."""
    snapshot = node_status(request.app.state.config, request.app.state.service.pool)
    return Response(snapshot.to_json(), media_type="application/json")


@router.get("/metrics", tags=["ops"])
async def metrics(request: Request) -> Response:
    # Rendering reads engine stats, which wait for a running model step: keep it off the event loop.
    body = await asyncio.to_thread(request.app.state.service.metrics.render)
    return Response(body, media_type=CONTENT_TYPE)

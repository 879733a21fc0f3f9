"""Operational routes: /health (liveness), /ready (preloads done), /node/status (for routers),
/metrics (Prometheus)."""

from __future__ import annotations

import asyncio
import json
import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from edgeinfer.api import router_trust
from edgeinfer.api.errors import ApiError, bad_request, model_not_found
from edgeinfer.api.http.json_body import BoundedJSONRoute
from edgeinfer.node.fleet_status import node_status
from edgeinfer.obs.metrics import CONTENT_TYPE
from edgeinfer.pool.manager import UnknownModelError

router = APIRouter(route_class=BoundedJSONRoute)


@router.get("/health", tags=["ops"])
async def health() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/ready", tags=["ops"])
async def ready(request: Request) -> JSONResponse:
    """503 until start-up (including --preload) finished, and again from the moment the node is asked to
    stop (`draining` while requests in flight finish; server.NodeServer). `unhealthy`: resident members
    that cannot serve now (an engine loop that stopped, an upstream whose stats fail)."""
    draining = bool(getattr(request.app.state, "draining", False))
    is_ready = bool(getattr(request.app.state, "ready", False)) and not draining
    pool = request.app.state.service.pool
    resident = sorted(state.name for state in pool.states() if state.state == "resident")
    unhealthy = {name: why for name, m in pool.residents().items() if (why := m.health()) is not None}
    status = "draining" if draining else "ready" if is_ready else "starting"
    body = {"status": status, "resident_models": resident, "unhealthy": unhealthy}
    return JSONResponse(body, status_code=200 if is_ready else 503)


@router.get("/node/status", tags=["ops"])
async def status(request: Request) -> Response:
    """The NodeStatus routers read (the same JSON the node publishes on NATS)."""
    service = request.app.state.service
    snapshot = node_status(request.app.state.node_config, service.pool, service.adapters.warm())
    return Response(snapshot.to_json(), media_type="application/json")


@router.post("/node/prefetch", tags=["ops"])
async def prefetch(request: Request) -> JSONResponse:
    """A router's placement loop asks the pool to load a model in the background (`{"model": name}`).

    Only routers may: the request must carry a valid router signature (api/router_trust.py).
    """
    secret = request.app.state.node_config.router_secret
    headers = request.headers
    signed = secret is not None and router_trust.verify(
        secret,
        headers.get(router_trust.TENANT_HEADER, ""),
        headers.get(router_trust.TS_HEADER, ""),
        headers.get(router_trust.SIG_HEADER, ""),
        time.time(),
    )
    if not signed:
        raise ApiError(
            403, "only a router holding the shared secret may ask for a model load", code="forbidden"
        )
    try:
        body = await request.json()
    except ValueError as exc:
        reason = exc.msg if isinstance(exc, json.JSONDecodeError) else str(exc)
        raise bad_request(f'body must be JSON, {{"model": NAME}}: {reason}') from None
    pool = request.app.state.service.pool
    try:
        name = pool.resolve(str(body.get("model", "")) if isinstance(body, dict) else "")
    except UnknownModelError as exc:
        raise model_not_found(str(exc)) from None
    pool.prefetch(name)
    state = next(s.state for s in pool.states() if s.name == name)
    return JSONResponse({"model": name, "state": state}, status_code=202)


@router.get(
    "/metrics",
    tags=["ops"],
    responses={200: {"content": {CONTENT_TYPE: {"schema": {"type": "string"}}}}},
    response_class=Response,
)
async def metrics(request: Request) -> Response:
    # Rendering reads engine stats, which wait for a running model step: keep it off the event loop.
    body = await asyncio.to_thread(request.app.state.service.metrics.render)
    return Response(body, media_type=CONTENT_TYPE)

"""The FastAPI dependency that turns the Authorization header into a tenant (401 otherwise)."""

from __future__ import annotations

import dataclasses
import time
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from edgeinfer.api import router_trust
from edgeinfer.api.errors import unauthorized
from edgeinfer.api.router_trust import SIG_HEADER, TENANT_HEADER, TS_HEADER
from edgeinfer.api.tenants import Tenant
from edgeinfer.types.cache_salt import SALT_HEADER

# Declared so /openapi.json documents bearer auth; the registry reads the raw header itself.
_bearer = HTTPBearer(auto_error=False, description="API key from the node's tenants file")


def authenticated(
    request: Request, _: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> Tenant:
    """Runs before the body is validated, so a wrong key is a 401 whatever the body holds.

    A request a router signed (router_trust) carries its tenant, and the tenant's cache salt, which then
    is its cache namespace here (the router derived it from the authenticated tenant); a forged or
    expired signature is a 401. Nodes without the routers' secret ignore those headers and check the API
    key themselves.
    """
    tenants = request.app.state.service.tenants
    secret = request.app.state.node_config.router_secret
    if secret is not None and TENANT_HEADER in request.headers:
        tenant = tenants.by_name(_trusted_tenant(request, secret))
        if salt := request.headers.get(SALT_HEADER, ""):
            tenant = dataclasses.replace(tenant, cache_namespace=salt)
    else:
        tenant = tenants.authenticate(request.headers.get("authorization"))
    request.state.access["tenant"] = tenant.name
    return tenant


def _trusted_tenant(request: Request, secret: bytes) -> str:
    headers = request.headers
    name = headers[TENANT_HEADER]
    ts, sig = headers.get(TS_HEADER, ""), headers.get(SIG_HEADER, "")
    if not router_trust.verify(secret, name, ts, sig, time.time(), headers.get(SALT_HEADER, "")):
        raise unauthorized("invalid or expired router signature on the tenant header")
    return name


AuthTenant = Annotated[Tenant, Depends(authenticated)]

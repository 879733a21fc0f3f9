"""The FastAPI dependency that turns the Authorization header into a tenant (401 otherwise)."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from edgeinfer.node.tenants import Tenant

# Declared so /openapi.json documents bearer auth; the registry reads the raw header itself.
_bearer = HTTPBearer(auto_error=False, description="API key from the node's tenants file")


def authenticated(
    request: Request, _: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> Tenant:
    """Runs before the body is validated, so a wrong key is a 401 whatever the body holds."""
    tenant = request.app.state.service.tenants.authenticate(request.headers.get("authorization"))
    request.state.access["tenant"] = tenant.name
    return tenant


AuthTenant = Annotated[Tenant, Depends(authenticated)]

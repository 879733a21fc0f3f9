"""The backend that runs jobs on each kind of pool member, looked up by the member's `kind`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from edgeinfer.api.errors import internal
from edgeinfer.api.limits import NodeLimits
from edgeinfer.api.tenants import Tenant
from edgeinfer.node.backends.base import Backend
from edgeinfer.node.backends.local import LocalBackend
from edgeinfer.node.backends.upstream import UpstreamBackend
from edgeinfer.pool.member import LocalMember, PoolMember
from edgeinfer.pool.upstream import UpstreamMember

BACKENDS: dict[str, Callable[[Any, NodeLimits, Tenant], Backend]] = {
    LocalMember.kind: LocalBackend,
    UpstreamMember.kind: UpstreamBackend,
}


def open_backend(member: PoolMember, limits: NodeLimits, tenant: Tenant) -> Backend:
    """A backend for one job on `member` (500 for a kind that runs no generation jobs)."""
    make = BACKENDS.get(member.kind)
    if make is None:
        raise internal(f"no generation backend for pool member kind {member.kind!r}")
    return make(member, limits, tenant)

"""Tenants: who is calling, their limits and prices, and their server-derived cache namespace."""

from __future__ import annotations

import enum
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from edgeinfer.api.adapters import TenantAdapter, parse_adapters
from edgeinfer.api.errors import bad_request, unauthorized
from edgeinfer.api.keys import hash_key
from edgeinfer.api.prices import Price
from edgeinfer.types.cache_salt import tenant_salt

logger = logging.getLogger("edgeinfer.node")

OPEN_TENANT = "default"
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_LIMIT_FIELDS = ("requests_per_minute", "tokens_per_minute", "max_concurrent")
# Weights (> 0, default 1): `weight` in the fair share of prefill across tenants, `cache_share` in the
# share of cached KV blocks that eviction keeps for each tenant.
_SHARE_FIELDS = ("weight", "cache_share")
_OUTAGE_FIELD = "limits_on_outage"
# The request `priority` a tenant may set (lower runs first): [0, 0] unless its entry widens it.
_PRIORITY_FIELDS = ("min_priority", "max_priority")


class OutagePolicy(enum.StrEnum):
    """What a router does with a tenant's requests while the fleet's limit store (NATS) is unreachable:
    `open` enforces the limits per router (so up to R times them with R routers; the nodes' own limits
    still hold per node), `closed` refuses with 503 until the store is back."""

    OPEN = "open"
    CLOSED = "closed"


@dataclass(frozen=True)
class TenantLimits:
    """None: unlimited. On a node the windows are 60 s sliding windows (node/billing/ratelimit.py); on the
    routers, fleet-wide fixed windows (router/limits/)."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent: int | None = None
    on_outage: OutagePolicy = OutagePolicy.OPEN

    @property
    def any(self) -> bool:
        return any(getattr(self, name) is not None for name in _LIMIT_FIELDS)

    def __post_init__(self) -> None:
        for name in _LIMIT_FIELDS:
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"tenant limit {name} must be an integer >= 1, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class Tenant:
    name: str
    cache_namespace: str
    limits: TenantLimits = field(default_factory=TenantLimits)
    # Partial per-model price overrides (only the fields that differ from the node's price table).
    prices: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    weight: float = 1.0
    cache_share: float = 1.0
    min_priority: int = 0
    max_priority: int = 0
    # LoRA adapters by name (api/adapters.py)
    adapters: Mapping[str, TenantAdapter] = field(default_factory=dict)

    def check_priority(self, priority: int) -> None:
        """ApiError 400 for a request `priority` outside the tenant's range."""
        if not self.min_priority <= priority <= self.max_priority:
            raise bad_request(
                f"priority {priority} is outside this key's range [{self.min_priority}, {self.max_priority}]",
                "priority",
            )


def cache_namespace(secret: bytes, tenant: str) -> str:
    """The tenant's salt under the server secret (types/cache_salt.py): stable per tenant, unguessable,
    never client-set."""
    return tenant_salt(secret, tenant)


class TenantRegistry:
    """Maps bearer keys (by their SHA-256) to tenants; open mode maps every caller to one tenant."""

    def __init__(self, by_key_hash: Mapping[str, Tenant], open_tenant: Tenant | None = None) -> None:
        if not by_key_hash and open_tenant is None:
            raise ValueError("a tenants file must define at least one tenant")
        self._by_hash = dict(by_key_hash)
        self._by_name = {tenant.name: tenant for tenant in self._by_hash.values()}
        self._open = open_tenant

    @property
    def is_open(self) -> bool:
        return self._open is not None

    @classmethod
    def open(cls, secret: bytes) -> TenantRegistry:
        logger.warning(
            "NO TENANTS FILE: the server runs OPEN — every caller is tenant %r, no API key is checked "
            "and no per-key limit applies. Pass --tenants FILE to require keys.",
            OPEN_TENANT,
        )
        return cls({}, Tenant(name=OPEN_TENANT, cache_namespace=cache_namespace(secret, OPEN_TENANT)))

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], secret: bytes) -> TenantRegistry:
        """`{"tenants": [{"name", "key_sha256", limits..., "prices": {model: {...}}}]}`."""
        entries = data.get("tenants")
        if not isinstance(entries, list) or not entries:
            raise ValueError("tenants file: needs a non-empty `tenants` list ([[tenants]] in TOML)")
        by_hash: dict[str, Tenant] = {}
        names: set[str] = set()
        for i, entry in enumerate(entries):
            key_hash, tenant = _parse_entry(entry, i, secret)
            if tenant.name in names or key_hash in by_hash:
                raise ValueError(f"tenants[{i}]: duplicate tenant name or key ({tenant.name!r})")
            names.add(tenant.name)
            by_hash[key_hash] = tenant
        return cls(by_hash)

    def by_name(self, name: str) -> Tenant:
        """The tenant a router vouched for (open mode: the open tenant); 401 ApiError when unknown."""
        if self._open is not None:
            return self._open
        tenant = self._by_name.get(name)
        if tenant is None:
            raise unauthorized(f"tenant {name!r} (from the router) is not in this node's tenants file")
        return tenant

    def authenticate(self, authorization: str | None) -> Tenant:
        """The tenant for an `Authorization: Bearer KEY` header; 401 ApiError otherwise."""
        if self._open is not None:
            return self._open
        if not authorization:
            raise unauthorized("missing API key: send the header `Authorization: Bearer <key>`")
        scheme, _, key = authorization.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise unauthorized("malformed Authorization header: expected `Bearer <key>`")
        tenant = self._by_hash.get(hash_key(key.strip()))
        if tenant is None:
            raise unauthorized("invalid API key")
        return tenant


def _parse_entry(entry: Any, index: int, secret: bytes) -> tuple[str, Tenant]:
    where = f"tenants[{index}]"
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: must be a table/object")
    known = {
        "name",
        "key_sha256",
        "prices",
        "adapters",
        _OUTAGE_FIELD,
        *_LIMIT_FIELDS,
        *_SHARE_FIELDS,
        *_PRIORITY_FIELDS,
    }
    unknown = set(entry) - known
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {sorted(unknown)}")
    name, key_hash = entry.get("name"), str(entry.get("key_sha256", "")).lower()
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}: `name` must be a non-empty string")
    if not _HEX64.match(key_hash):
        raise ValueError(
            f"{where} ({name}): `key_sha256` must be 64 hex digits (python -m edgeinfer.node.keys)"
        )
    limits = TenantLimits(
        **{k: entry[k] for k in _LIMIT_FIELDS if k in entry}, on_outage=_outage(entry, where)
    )
    prices = dict(entry.get("prices", {}))
    for model, override in prices.items():
        Price.from_mapping(override, where=f"{where}.prices.{model}")  # validated now, applied when billing
    shares = {k: _share(entry[k], f"{where}.{k}") for k in _SHARE_FIELDS if k in entry}
    namespace = cache_namespace(secret, name)
    tenant = Tenant(
        name=name,
        cache_namespace=namespace,
        limits=limits,
        prices=prices,
        **shares,
        **_priorities(entry, where),
        adapters=parse_adapters(entry.get("adapters", []), where),
    )
    return key_hash, tenant


def _share(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"{where}: must be a number > 0, got {value!r}")
    return float(value)


def _outage(entry: dict[str, Any], where: str) -> OutagePolicy:
    value = entry.get(_OUTAGE_FIELD, OutagePolicy.OPEN.value)
    try:
        return OutagePolicy(value)
    except ValueError:
        known = ", ".join(OutagePolicy)
        raise ValueError(f"{where}.{_OUTAGE_FIELD}: must be one of {known}, got {value!r}") from None


def _priorities(entry: dict[str, Any], where: str) -> dict[str, int]:
    bounds = {k: entry.get(k, 0) for k in _PRIORITY_FIELDS}
    for k, value in bounds.items():
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{where}.{k}: must be an integer, got {value!r}")
    if not bounds["min_priority"] <= 0 <= bounds["max_priority"]:
        raise ValueError(
            f"{where}: min_priority <= 0 <= max_priority (0, the default priority, is always allowed)"
        )
    return bounds

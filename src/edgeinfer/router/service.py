"""One request through the router: authenticate → validate → admit (fleet limits) → decide → forward
(proxy.py)."""

from __future__ import annotations

import random
import time
from collections import OrderedDict, deque

from fastapi.responses import Response
from starlette.requests import Request

from edgeinfer.api import router_trust
from edgeinfer.api.errors import ApiError, busy, model_not_found
from edgeinfer.api.tenants import Tenant, TenantRegistry
from edgeinfer.router.config import RouterConfig
from edgeinfer.router.limits.limiter import FleetAdmission, FleetLimiter
from edgeinfer.router.metrics import RouterMetrics
from edgeinfer.router.placement import PlacementLoop
from edgeinfer.router.policy import Decision, DecisionKind, RequestFeatures, decide
from edgeinfer.router.proxy import HOP_BY_HOP, Forward, Forwarder, RelayResponse
from edgeinfer.router.state import FleetState
from edgeinfer.types.cache_salt import tenant_salt

CLIENT_LOCATION_HEADER = "x-client-location"
AFFINITY_HEADER = "x-session-affinity"
# The router does not tokenize: ~4 bytes of JSON body per prompt token is close enough for ranking.
BYTES_PER_TOKEN = 4
MAX_SESSIONS = 100_000
RECENT_SPILLS = 20  # shown on the status page


class SessionMemory:
    """Which node served a session's last turn and how long its prompt was: the policy counts that
    prefix as cached there (LRU, bounded)."""

    def __init__(self, capacity: int = MAX_SESSIONS) -> None:
        self._capacity = capacity
        self._last: OrderedDict[str, tuple[str, int]] = OrderedDict()

    def cached_tokens(self, key: str | None, prompt_tokens: int) -> dict[str, int]:
        if key is None or key not in self._last:
            return {}
        node_id, tokens = self._last[key]
        self._last.move_to_end(key)
        return {node_id: min(tokens, prompt_tokens)}

    def remember(self, key: str, node_id: str, prompt_tokens: int) -> None:
        self._last[key] = (node_id, prompt_tokens)
        self._last.move_to_end(key)
        while len(self._last) > self._capacity:
            self._last.popitem(last=False)


class RouterService:
    def __init__(
        self,
        config: RouterConfig,
        *,
        tenants: TenantRegistry,
        state: FleetState,
        forwarder: Forwarder,
        metrics: RouterMetrics,
        placement: PlacementLoop | None = None,
        limiter: FleetLimiter | None = None,
    ) -> None:
        self.config = config
        self.limiter = limiter
        self.tenants = tenants
        self.state = state
        self.forwarder = forwarder
        self.metrics = metrics
        self.placement = placement
        self.sessions = SessionMemory()
        self.recent_spills: deque[dict[str, object]] = deque(maxlen=RECENT_SPILLS)
        self.rng = random.Random(config.seed)
        secret = config.router_secret
        self._salt_key = router_trust.cache_salt_key(secret) if secret else None

    def cache_salt(self, tenant: Tenant) -> str:
        """The tenant's salt ("" without a router secret: nodes then derive namespaces themselves)."""
        return tenant_salt(self._salt_key, tenant.name) if self._salt_key is not None else ""

    def client_location(self, request: Request) -> str:
        code = request.headers.get(CLIENT_LOCATION_HEADER, "").strip().upper()
        return code if code in self.state.fleet.rtt else self.config.location

    def is_embedding_model(self, model: str) -> bool:
        """As the node's `model_task`: known only from live nodes' statuses; 404 for a model none serves."""
        max_age = self.config.policy.drop_after_s
        if model not in self.state.served_models(max_age):
            raise self._unknown(model)
        return model in self.state.embedding_models(max_age)

    def _unknown(self, model: str) -> ApiError:
        served = ", ".join(sorted(self.state.served_models(self.config.policy.drop_after_s))) or "nothing"
        return model_not_found(f"model {model!r} does not exist; this fleet serves: {served}")

    async def route(self, request: Request, tenant: Tenant, model: str, output_tokens: int = 0) -> Response:
        """Generation and embedding requests alike: the same limits, policy, retries, tenants and metrics.
        `output_tokens`: the most the request may generate (all choices), reserved against tokens/min
        with the prompt's estimate until the node's usage event says what it used."""
        started = getattr(request.state, "arrived", time.monotonic())
        body = await request.body()
        admission = None
        if self.limiter is not None:
            request_id = request.headers.get("x-request-id", "")
            reserve = len(body) // BYTES_PER_TOKEN + output_tokens
            admission = await self.limiter.admit(tenant, request_id, reserve)
        try:
            response = await self._route(request, tenant, model, body, started)
        except BaseException as exc:
            if admission is not None:
                admission.end(exc.status if isinstance(exc, ApiError) else 500)
            raise
        if admission is not None:
            _end_with(response, admission)
        return response

    async def _route(
        self, request: Request, tenant: Tenant, model: str, body: bytes, started: float
    ) -> Response:
        location = self.client_location(request)
        affinity = request.headers.get(AFFINITY_HEADER)
        salt = self.cache_salt(tenant)
        # Prefix-aware choices key on the salt (hex, so "/" cannot be part of it) where there is one.
        session = f"{salt or tenant.name}/{affinity}" if affinity else None
        tokens = len(body) // BYTES_PER_TOKEN
        cached = self.sessions.cached_tokens(session, tokens)
        features = RequestFeatures(
            model=model,
            prompt_tokens=tokens,
            client_location=location,
            affinity_key=affinity,
            tenant=tenant.name,
            cached_tokens=cached,
            cache_salt=salt,
        )
        if self.placement is not None:
            self.placement.demand.add(location, model)
        decision = self._decide(features)
        headers = self._node_headers(request, tenant, location, salt)
        forward = Forward(
            path=request.url.path, body=body, headers=headers, client_location=location, started=started
        )
        response = await self.forwarder.forward(request, forward, decision.ranked)
        node_id = response.headers.get("x-edgeinfer-node")
        if session is not None and node_id is not None:
            self.sessions.remember(session, node_id, tokens)
        return response

    def _decide(self, features: RequestFeatures) -> Decision:
        t0 = time.perf_counter()
        decision = decide(self.state.snapshot(), features, self.rng, self.config.policy, self.config.strategy)
        self.metrics.decision.observe(time.perf_counter() - t0)
        if decision.kind is DecisionKind.UNKNOWN_MODEL:
            raise self._unknown(features.model)
        if decision.kind is DecisionKind.REJECT:
            self.metrics.rejected.labels(features.model).inc()
            raise busy(f"every node serving {features.model} is busy; retry shortly", decision.retry_after_s)
        if decision.spilled and decision.best is not None:
            self.metrics.spillovers.labels(features.client_location).inc()
            best = decision.best
            self.recent_spills.append(
                {
                    "time": time.time(),
                    "model": features.model,
                    "client_location": features.client_location,
                    "node": best.node_id,
                    "location": best.location,
                }
            )
        return decision

    def _node_headers(self, request: Request, tenant: Tenant, location: str, salt: str) -> dict[str, str]:
        """The client's headers minus connection-level ones and any tenant header it sent (only a
        router may set those), plus the signed tenant and the resolved client location."""
        strip = HOP_BY_HOP | set(router_trust.TRUST_HEADERS)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in strip}
        headers[CLIENT_LOCATION_HEADER] = location
        if self.config.router_secret is not None:
            secret = self.config.router_secret
            headers.update(router_trust.signed_headers(secret, tenant.name, time.time(), salt))
        return headers


def _end_with(response: Response, admission: FleetAdmission) -> None:
    """The admission ends when the client has the whole answer (a relayed stream's end), else now."""
    if isinstance(response, RelayResponse):
        response.also_on_end(lambda: admission.end(response.status_code))
    else:
        admission.end(response.status_code)

"""One request through the router: authenticate → validate → admit (fleet limits) → decide → forward
(proxy.py)."""

from __future__ import annotations

import random
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable
from typing import Any

from edgeinfer.api import router_trust
from edgeinfer.api.adapters import adapter_key
from edgeinfer.api.errors import ApiError, bad_request, busy, model_not_found, unavailable
from edgeinfer.api.tenants import Tenant, TenantRegistry
from edgeinfer.api.usage import usage_body
from edgeinfer.batch.store import BatchStore
from edgeinfer.finetunes.store import JetStreamFinetunes
from edgeinfer.ledger.client import LedgerError, query_usage
from edgeinfer.router.bus import FleetBus
from edgeinfer.router.config import RouterConfig
from edgeinfer.router.limits.limiter import FleetAdmission, FleetLimiter
from edgeinfer.router.metrics import RouterMetrics
from edgeinfer.router.placement import PlacementLoop
from edgeinfer.router.policy import Decision, DecisionKind, RequestFeatures, decide
from edgeinfer.router.proxy import HOP_BY_HOP, Forward, Forwarder, Forwarding, Relay
from edgeinfer.router.state import FleetState
from edgeinfer.router.wire import Reply, Request
from edgeinfer.types.cache_salt import tenant_salt

CLIENT_LOCATION_HEADER = b"x-client-location"
AFFINITY_HEADER = b"x-session-affinity"
# Never passed from a client to a node: connection-level headers (`expect` too: the router sends the body
# at once), and what only a router may set.
_NOT_FORWARDED = (
    HOP_BY_HOP | {name.encode() for name in router_trust.TRUST_HEADERS} | {CLIENT_LOCATION_HEADER, b"expect"}
)
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


class Deferred:
    """An answer whose work all waits for the connection's task (it awaits something first)."""

    def __init__(self, work: Callable[[], Awaitable[Reply | Relay]]) -> None:
        self._work = work

    async def answer(self) -> Reply | Relay:
        return await self._work()

    def abandon(self) -> None:
        """Nothing was begun."""


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
        bus: FleetBus | None = None,
    ) -> None:
        self.config = config
        self.bus = bus
        self.limiter: FleetLimiter | None = bus.limiter if bus is not None else None
        self.tenants = tenants
        self.state = state
        self.forwarder = forwarder
        self.metrics = metrics
        self.placement = placement
        self.ready = False  # /ready: set once the router has started
        self.sessions = SessionMemory()
        self.recent_spills: deque[dict[str, object]] = deque(maxlen=RECENT_SPILLS)
        self.rng = random.Random(config.seed)
        secret = config.router_secret
        self._salt_key = router_trust.cache_salt_key(secret) if secret else None
        self._salts: dict[str, str] = {}  # per tenant name: the tenants file bounds it

    def cache_salt(self, tenant: Tenant) -> str:
        """The tenant's salt ("" without a router secret: nodes then derive namespaces themselves)."""
        if self._salt_key is None:
            return ""
        salt = self._salts.get(tenant.name)
        if salt is None:
            salt = self._salts[tenant.name] = tenant_salt(self._salt_key, tenant.name)
        return salt

    def client_location(self, request: Request) -> str:
        code = (request.text_header(CLIENT_LOCATION_HEADER) or "").strip().upper()
        return code if code in self.state.fleet.rtt else self.config.location

    def is_embedding_model(self, model: str) -> bool:
        """As the node's `model_task`: known only from live nodes' statuses; 404 for a model none serves."""
        max_age = self.config.policy.drop_after_s
        if model not in self.state.served_models(max_age):
            raise self._unknown(model)
        return self.embeds(model)

    def embeds(self, model: str) -> bool:
        """Whether a live node serves `model` as an embedding model (False for a model none serves)."""
        return model in self.state.embedding_models(self.config.policy.drop_after_s)

    def _unknown(self, model: str) -> ApiError:
        served = ", ".join(sorted(self.state.served_models(self.config.policy.drop_after_s))) or "nothing"
        return model_not_found(f"model {model!r} does not exist; this fleet serves: {served}")

    def route(
        self, request: Request, tenant: Tenant, model: str, output_tokens: int = 0, adapter: str | None = None
    ) -> Forwarding | Deferred:
        """Generation and embedding requests alike: the same limits, policy, retries, tenants and metrics.
        `output_tokens`: the most the request may generate (all choices), reserved against tokens/min
        with the prompt's estimate until the node's usage event says what it used. `adapter`: the tenant's
        LoRA adapter it names, placed where that is loaded. Without fleet limits the request is placed and
        on its way when this returns; with them, all of it waits for the admission."""
        if self.limiter is None:
            return self._route(request, tenant, model, adapter)
        return Deferred(lambda: self._admitted(request, tenant, model, output_tokens, adapter))

    async def _admitted(
        self, request: Request, tenant: Tenant, model: str, output_tokens: int, adapter: str | None
    ) -> Reply | Relay:
        assert self.limiter is not None
        reserve = len(request.body) // BYTES_PER_TOKEN + output_tokens
        admission = await self.limiter.admit(tenant, request.request_id, reserve)
        try:
            response = await self._route(request, tenant, model, adapter).answer()
        except BaseException as exc:
            if admission is not None:
                admission.end(exc.status if isinstance(exc, ApiError) else 500)
            raise
        if admission is not None:
            _end_with(response, admission)
        return response

    def _route(self, request: Request, tenant: Tenant, model: str, adapter: str | None = None) -> Forwarding:
        location = self.client_location(request)
        affinity = request.text_header(AFFINITY_HEADER)
        salt = self.cache_salt(tenant)
        # Prefix-aware choices key on the salt (hex, so "/" cannot be part of it) where there is one.
        session = f"{salt or tenant.name}/{affinity}" if affinity else None
        tokens = len(request.body) // BYTES_PER_TOKEN
        cached = self.sessions.cached_tokens(session, tokens)
        features = RequestFeatures(
            model=model,
            prompt_tokens=tokens,
            client_location=location,
            affinity_key=affinity,
            adapter=adapter_key(tenant.name, adapter) if adapter else None,
            tenant=tenant.name,
            cached_tokens=cached,
            cache_salt=salt,
        )
        if self.placement is not None:
            self.placement.demand.add(location, model)
        decision = self._decide(features)
        forward = Forward(
            target=request.target,
            body=request.body,
            header_lines=self._node_headers(request, tenant, location, salt),
            client_location=location,
            started=request.arrived,
        )
        if session is None:
            return self.forwarder.begin(forward, decision.ranked)

        def remember(relay: Relay) -> None:
            self.sessions.remember(session, relay.node_id, tokens)

        return self.forwarder.begin(forward, decision.ranked, remember)

    async def usage(self, tenant: Tenant, start: float | None, end: float | None) -> dict[str, Any]:
        """The tenant's usage across the fleet, from the ledger (`edgeinfer ledger`) over NATS, in the
        shape of a node's /v1/usage; 503 where no ledger can be asked."""
        if self.bus is None or self.bus.nc is None:
            raise unavailable(
                "fleet usage comes from the ledger over NATS: this router runs without --nats-url"
            )
        try:
            rows = await query_usage(self.bus.nc, tenant.name, start, end)
        except LedgerError as exc:
            raise unavailable(f"fleet usage: {exc}") from None
        return usage_body(tenant.name, start, end, rows)

    def finetune_store(self) -> JetStreamFinetunes:
        """The fleet's finetunes; 400 for a router without them (an upload must reach every node)."""
        if self.bus is None or self.bus.finetunes is None:
            message = "finetunes are kept by the fleet: start the router with --nats-url (JetStream on)"
            raise bad_request(message)
        return self.bus.finetunes

    def batch_store(self) -> BatchStore:
        """The Batch API's queue; 400 for a router without it."""
        if self.bus is None or self.bus.batch is None:
            message = "queueRequest needs the batch queue: start the router with --nats-url (JetStream on)"
            raise bad_request(message, "queueRequest")
        return self.bus.batch

    async def counted(
        self, request: Request, tenant: Tenant, work: Callable[[], Awaitable[dict[str, Any]]]
    ) -> dict[str, Any]:
        """A call the router answers itself (a Batch-API submission or poll, a finetunes call): one request
        against the tenant's fleet limits (no tokens: queued entries count against the limits of the
        nodes that run them)."""
        admission = await self.limiter.admit(tenant, request.request_id, 0) if self.limiter else None
        status = 500
        try:
            answer = await work()
            status = 200
            return answer
        except ApiError as exc:
            status = exc.status
            raise
        finally:
            if admission is not None:
                admission.end(status)

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

    def _node_headers(self, request: Request, tenant: Tenant, location: str, salt: str) -> bytes:
        """The client's header lines minus connection-level ones and any tenant header it sent (only a
        router may set those), plus the request id, the signed tenant and the resolved client location."""
        lines = [b"%s: %s\r\n" % (k, v) for k, v in request.headers if k not in _NOT_FORWARDED]
        lines.append(
            b"x-request-id: %s\r\nx-client-location: %s\r\n"
            % (request.request_id.encode(), location.encode())
        )
        if self.config.router_secret is not None:
            signed = router_trust.signed_headers(self.config.router_secret, tenant.name, time.time(), salt)
            lines += [f"{k}: {v}\r\n".encode() for k, v in signed.items()]
        return b"".join(lines)


def _end_with(response: Reply | Relay, admission: FleetAdmission) -> None:
    """The admission ends when the client has the whole answer (a relayed stream's end), else now."""
    if isinstance(response, Relay):
        response.also_on_end(lambda: admission.end(response.status))
    else:
        admission.end(response.status)

"""One router: its fleet state, its service, and the data plane's entry point (`Router.handle`)."""

from __future__ import annotations

import contextlib
import logging
import secrets

import httpx

from edgeinfer.api.errors import ApiError, unexpected
from edgeinfer.api.files import load_table
from edgeinfer.api.tenants import TenantRegistry
from edgeinfer.router import routes
from edgeinfer.router.breaker import CircuitBreaker
from edgeinfer.router.bus import FleetBus
from edgeinfer.router.config import RouterConfig
from edgeinfer.router.fleet_file import Fleet
from edgeinfer.router.http_server import ClientConnection, Pending
from edgeinfer.router.limits.tenants_check import tenants_digest
from edgeinfer.router.metrics import RouterMetrics
from edgeinfer.router.placement import PlacementLoop
from edgeinfer.router.proxy import Forwarder
from edgeinfer.router.service import RouterService
from edgeinfer.router.sources import PollSource
from edgeinfer.router.state import FleetState
from edgeinfer.router.wire import Reply, Request, error_reply

logger = logging.getLogger("edgeinfer.router")


class Router:
    """Built from its config and fleet file; `start` connects it to the fleet (NATS or polling),
    `protocol` makes the data plane's protocol for a client connection, `stop` lets go of everything."""

    def __init__(self, config: RouterConfig, fleet: Fleet) -> None:
        if config.location not in fleet.rtt:
            raise ValueError(f"router location {config.location!r} is not a location of the fleet file")
        # The router's registry only checks keys; cache namespaces are derived on the nodes.
        namespace_key = secrets.token_bytes(32)
        self._table = load_table(config.tenants_file) if config.tenants_file else None
        if self._table is not None:
            self.tenants = TenantRegistry.from_mapping(self._table, namespace_key)
        else:
            self.tenants = TenantRegistry.open(namespace_key)
        self.config = config
        self.fleet = fleet
        self.max_body_bytes = config.limits.max_body_bytes
        self.state = FleetState(
            fleet, lambda: CircuitBreaker(config.breaker_failures, config.breaker_reset_s)
        )
        views = self.state.nodes.values()
        self.metrics = RouterMetrics(lambda: [(v.entry.node_id, v.breaker.state) for v in views])
        self.connections: set[ClientConnection] = set()
        self.service: RouterService | None = None
        self._stack = contextlib.AsyncExitStack()

    def protocol(self) -> ClientConnection:
        return ClientConnection(self, self.connections)

    async def start(self) -> None:
        config = self.config
        # Placement asks only: requests and status polls go over the data plane's pools (the forwarder's).
        client = await self._stack.enter_async_context(
            httpx.AsyncClient(timeout=httpx.Timeout(config.idle_timeout_s, connect=config.connect_timeout_s))
        )
        forwarder = Forwarder(config, self.state, self.metrics)
        self._stack.callback(forwarder.close)
        bus = (
            FleetBus(config, self.state, self.metrics, tenants_digest(self._table))
            if config.nats_url
            else None
        )
        source: FleetBus | PollSource = bus if bus is not None else PollSource(self.state, forwarder.pools)
        await source.start()
        self._stack.push_async_callback(source.stop)
        placement = None
        if config.placement is not None and config.router_secret is not None:
            placement = PlacementLoop(
                self.state, client, config.router_secret, config.placement, config.policy
            )
        self.service = RouterService(
            config,
            tenants=self.tenants,
            state=self.state,
            forwarder=forwarder,
            metrics=self.metrics,
            placement=placement,
            bus=bus,
        )
        if placement is not None:
            await placement.start()
            self._stack.push_async_callback(placement.stop)
        self.service.ready = True
        logger.info("router ready at %s; %d nodes in the fleet file", config.location, len(self.fleet.nodes))

    async def stop(self) -> None:
        if self.service is not None:
            self.service.ready = False
        await self._stack.aclose()

    def begin(self, request: Request) -> Reply | Pending | None:
        """A data-plane request begun where it arrives (routes.begin): under way, or its error's answer.
        None for the other routes, which `handle` answers."""
        assert self.service is not None
        try:
            return routes.begin(self.service, request)
        except ApiError as error:
            return error_reply(error, request.path)
        except Exception:
            logger.exception("unhandled error on %s (request id %s)", request.path, request.request_id)
            return error_reply(unexpected(request.request_id), request.path)

    async def handle(self, request: Request, begun: Pending | None) -> routes.Answer:
        """Every request's answer (`begun`'s where `begin` began it): the route's, or its error in the
        route's envelope. An unexpected error is a 500 naming the request id (the details go to the log),
        and the connection stays usable."""
        assert self.service is not None
        try:
            if begun is not None:
                return await begun.answer()
            return await routes.dispatch(self.service, request)
        except ApiError as error:
            return error_reply(error, request.path)
        except Exception:
            logger.exception("unhandled error on %s (request id %s)", request.path, request.request_id)
            return error_reply(unexpected(request.request_id), request.path)

"""Frozen configuration of one router."""

from __future__ import annotations

from dataclasses import dataclass, field

from edgeinfer.api.limits import NodeLimits
from edgeinfer.batch.settings import BatchSettings
from edgeinfer.router.limits.limiter import FleetLimitsConfig
from edgeinfer.router.placement import PlacementConfig
from edgeinfer.router.policy import PolicyConfig, Strategy


@dataclass(frozen=True, kw_only=True)
class RouterConfig:
    location: str  # the router's own location: clients without x-client-location are counted here
    tenants_file: str | None = None
    router_secret: bytes | None = None  # signs the tenant header for nodes (api/router_trust.py)
    nats_url: str | None = None  # fleet state from NATS; None: poll every node's /node/status
    # Tenants' limits across the fleet, on NATS JetStream (router/limits/); without NATS the router enforces
    # none and the nodes' own limits hold, per node.
    fleet_limits: FleetLimitsConfig = field(default_factory=FleetLimitsConfig)
    batch: BatchSettings = field(default_factory=BatchSettings)  # the Batch API's queue, on NATS JetStream
    poll_interval_s: float = 0.1
    strategy: Strategy = Strategy.TTFT
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    # The same request limits as the nodes', so that malformed bodies get the node's 4xx here.
    limits: NodeLimits = field(default_factory=NodeLimits)
    emulate_rtt: bool = False
    connect_timeout_s: float = 1.0
    first_byte_timeout_s: float = 120.0  # from arrival to the node's response headers, retries included
    idle_timeout_s: float = 120.0  # longest silence between two chunks of a response
    max_attempts: int = 3
    breaker_failures: int = 3
    breaker_reset_s: float = 2.0
    # Warm-pool placement (router/placement.py); runs only with a router secret, which signs its asks.
    placement: PlacementConfig | None = field(default_factory=PlacementConfig)
    seed: int | None = None  # for the policy's random choices (tests, benchmarks)

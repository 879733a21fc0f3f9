"""The router's NATS connection and what runs on it: node statuses (sources.py), the tenants' fleet
limits (limits/), the check that every router holds the same tenants file, the nodes' usage events,
which settle the limits' token reservations, the Batch API's queue (batch/) and the tenants' uploaded
finetunes (finetunes/)."""

from __future__ import annotations

import logging
import secrets
from typing import Any

from edgeinfer.batch.store import BatchStore
from edgeinfer.finetunes.store import JetStreamFinetunes
from edgeinfer.router.config import RouterConfig
from edgeinfer.router.limits.limiter import FleetLimiter
from edgeinfer.router.limits.tenants_check import TenantsCheck
from edgeinfer.router.metrics import RouterMetrics
from edgeinfer.router.sources import NatsSource
from edgeinfer.router.state import FleetState
from edgeinfer.types.usage_event import USAGE_SUBJECT_PREFIX, UsageEvent

logger = logging.getLogger("edgeinfer.router")


class FleetBus:
    def __init__(self, config: RouterConfig, state: FleetState, metrics: RouterMetrics, tenants_digest: str):
        assert config.nats_url is not None
        self.config = config
        self.router_id = f"{config.location}-{secrets.token_hex(6)}"
        self.nc: Any = None
        self.limiter: FleetLimiter | None = None
        self.batch: BatchStore | None = None  # the Batch API's queue (None: NATS without JetStream)
        self.finetunes: JetStreamFinetunes | None = None  # tenants' uploaded LoRA adapters (likewise)
        self._state = state
        self._metrics = metrics
        self._digest = tenants_digest
        self._source: NatsSource | None = None
        self._check: TenantsCheck | None = None

    async def start(self) -> None:
        import nats

        self.nc = await nats.connect(
            self.config.nats_url, name=f"edgeinfer-router-{self.router_id}", max_reconnect_attempts=-1
        )
        self._source = NatsSource(self.nc, self._state)
        await self._source.start()
        js = self.nc.jetstream(timeout=self.config.fleet_limits.op_timeout_s * 4)
        try:
            limiter = FleetLimiter(
                js, self.router_id, self.config.fleet_limits, self._metrics, lambda: self.nc.is_connected
            )
            await limiter.start()
            self._check = TenantsCheck(js, self.router_id, self._digest, self._metrics)
            await self._check.start()
            batch = await BatchStore(js, self.config.batch).open()
        except Exception as exc:  # the server runs without JetStream (`nats-server -js` has it)
            logger.error(
                "fleet limits off: NATS at %s has no JetStream (%s); only the nodes' own limits hold",
                self.config.nats_url,
                exc,
            )
            return
        self.limiter, self.batch = limiter, batch
        self.finetunes = await JetStreamFinetunes(js).open()
        await self.nc.subscribe(f"{USAGE_SUBJECT_PREFIX}.>", cb=self._on_usage)

    async def _on_usage(self, msg: Any) -> None:  # a nats.aio.msg.Msg
        if self.limiter is None:
            return
        try:
            event = UsageEvent.from_json(msg.data)
        except ValueError:
            return  # the ledger keeps malformed events aside; nothing here to settle
        self.limiter.settle(event)

    async def stop(self) -> None:
        if self._check is not None:
            await self._check.stop()
        if self.limiter is not None:
            await self.limiter.stop()
        if self._source is not None:
            await self._source.stop()
        if self.nc is not None:
            try:
                await self.nc.close()
            except Exception as exc:  # closing a connection that is already down
                logger.debug("closing NATS: %s", exc)

"""The node's HTTP server: uvicorn configured from `NodeConfig` (timeouts, proxies, connection bounds), with
a drain before it shuts down."""

from __future__ import annotations

import asyncio
import logging
import socket
import sys
import time
from typing import Any

import uvicorn

from edgeinfer.node.config import NodeConfig
from edgeinfer.node.http.connections import guarded_protocol

logger = logging.getLogger("edgeinfer.node")


def configure_process(config: NodeConfig) -> None:
    """The process-wide settings of a node server, set once by its entry point before it serves (not by
    the engines it loads: several share the process)."""
    sys.setswitchinterval(config.switch_interval_s)


def uvicorn_config(app: Any, config: NodeConfig, host: str, port: int, **options: Any) -> uvicorn.Config:
    """X-Forwarded-For is believed only from `trusted_proxies` (uvicorn's own default trusts loopback)."""
    limits = config.connections
    trusted = list(config.trusted_proxies)
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        # asyncio's loop even where uvloop is installed (for the router): the node's connection guard is an
        # h11 protocol and its tests (send buffers, disconnects) are written against asyncio transports.
        loop="asyncio",
        http=guarded_protocol(limits, frozenset(trusted)),
        timeout_keep_alive=limits.keep_alive_timeout_s,  # type: ignore[arg-type]  # a float works
        timeout_graceful_shutdown=limits.shutdown_grace_s,  # type: ignore[arg-type]
        proxy_headers=bool(trusted),
        forwarded_allow_ips=trusted or None,
        access_log=False,
        **options,
    )


class NodeServer(uvicorn.Server):
    """uvicorn's server, draining first when asked to stop (SIGTERM, Ctrl-C, `should_exit`): while requests
    are in flight the listener stays open and `/ready` answers 503 `draining`, so that load balancers stop
    sending here while streams finish. Once none is left, or the grace (`timeout_graceful_shutdown`) is
    over, uvicorn's own shutdown runs: it stops accepting, closes idle connections, and aborts what is
    still running when the rest of the grace is over."""

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if not self.force_exit:
            grace = self.config.timeout_graceful_shutdown
            spent = await self._drain(grace)
            if grace is not None:
                # One grace for the whole shutdown, as documented, not one for each phase.
                self.config.timeout_graceful_shutdown = max(0.0, grace - spent)  # type: ignore[assignment]
        await super().shutdown(sockets)

    async def _drain(self, grace: float | None) -> float:
        """Wait until no request is in flight or `grace` seconds passed; returns the seconds spent."""
        started = time.monotonic()
        state = getattr(self.config.app, "state", None)
        if state is not None:
            state.ready, state.draining = False, True
        in_flight = self.server_state.tasks
        if in_flight:
            logger.info("draining: %d requests in flight; /ready answers 503", len(in_flight))
        while in_flight and not self.force_exit:
            if grace is not None and time.monotonic() - started >= grace:
                break
            await asyncio.sleep(0.05)
        return time.monotonic() - started

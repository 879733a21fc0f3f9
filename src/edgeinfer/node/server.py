"""The node's HTTP server: uvicorn configured from `NodeConfig` (timeouts, proxies, connection bounds)."""

from __future__ import annotations

import sys
from typing import Any

import uvicorn

from edgeinfer.node.config import NodeConfig
from edgeinfer.node.connections import guarded_protocol


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

"""Frozen configuration of the node server."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from edgeinfer.api.limits import NodeLimits
from edgeinfer.batch.settings import BatchSettings


def _state_dir() -> Path:
    """`$XDG_STATE_HOME/edgeinfer` (default `~/.local/state/edgeinfer`)."""
    return Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state") / "edgeinfer"


def default_usage_db() -> str:
    return str(_state_dir() / "usage.sqlite")


def default_finetunes_dir() -> str:
    """Where a node that is not on NATS keeps its tenants' uploaded finetunes."""
    return str(_state_dir() / "finetunes")


@dataclass(frozen=True)
class ConnectionLimits:
    """What a slow, stalled or greedy client may hold (seconds, connections); defaults in docs/server.md."""

    header_timeout_s: float = 10.0  # from connecting (or the previous response) to the end of the headers
    body_timeout_s: float = 30.0  # from the end of the headers to the end of the body (else 408)
    keep_alive_timeout_s: float = 5.0  # an idle connection between requests is closed
    max_connections_per_client: int = 64  # per client address, proxies in trusted_proxies exempt
    stream_write_timeout_s: float = 30.0  # a stream whose reader takes nothing this long is aborted
    shutdown_grace_s: float = 30.0  # on SIGTERM, requests in flight get this long, then are aborted

    def __post_init__(self) -> None:
        for name in self.__dataclass_fields__:
            if not getattr(self, name) > 0:
                raise ValueError(f"{name.replace('_', '-')} must be > 0")


@dataclass(frozen=True, kw_only=True)
class NodeConfig:
    """How the server authenticates, meters and bounds requests. The pool is configured separately."""

    limits: NodeLimits = field(default_factory=NodeLimits)
    connections: ConnectionLimits = field(default_factory=ConnectionLimits)
    # Peers whose X-Forwarded-For names the client (the router's addresses); nobody's by default.
    trusted_proxies: tuple[str, ...] = ()
    tenants_file: str | None = None
    prices_file: str | None = None
    usage_db: str = field(default_factory=default_usage_db)
    finetunes_dir: str = field(default_factory=default_finetunes_dir)  # on NATS: the fleet's store instead
    # HMAC key for tenant cache namespaces; random per process when unset (the KV cache is in-process).
    server_secret: bytes | None = None
    preload: tuple[str, ...] = ()
    # Usage of requests in flight is saved this often, so a crash loses at most this much of it.
    usage_checkpoint_s: float = 1.0
    # Fleet membership: how routers know this node (docs/router.md).
    node_id: str = ""
    location: str = ""
    nats_url: str | None = None  # publish NodeStatus there every status_interval_s, and usage events
    status_interval_s: float = 0.1
    # The Batch API's queue on the same NATS (batch/store.py); entries of one model run at once here (None:
    # one per engine seat; 0: none, the node only takes submissions and polls).
    batch: BatchSettings = field(default_factory=BatchSettings)
    batch_slots: int | None = None
    # Shared with the routers: a request signed with it carries a tenant the node trusts (router_trust).
    router_secret: bytes | None = None
    # The interpreter's switch interval, set once when the server starts (http/server.configure_process).
    # An engine's step thread releases the GIL inside every torch op and takes it back many times a step;
    # while the event loop holds it (rendering and writing stream chunks) each retake can wait this long,
    # so a short interval keeps the engine stepping (docs/benchmarks.md has what it bought).
    switch_interval_s: float = 0.0005

    def __post_init__(self) -> None:
        if not self.switch_interval_s > 0:
            raise ValueError("switch interval must be > 0")
        if self.nats_url and not self.node_id:
            raise ValueError("a node on NATS needs a node id (its status and usage events are named by it)")

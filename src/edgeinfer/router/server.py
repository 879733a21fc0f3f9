"""Serving a router: the data plane's protocol on uvloop, in one process or in `workers` processes that each
bind the port with SO_REUSEPORT (the kernel spreads connections over them). Each worker is a whole router
with its own fleet state, NATS connection and fleet-limit leases, as separate routers would be."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable

import uvloop

from edgeinfer.router.app import Router
from edgeinfer.router.config import RouterConfig
from edgeinfer.router.fleet_file import Fleet

logger = logging.getLogger("edgeinfer.router")
GRACEFUL_SHUTDOWN_S = 10
BACKLOG = 4096


async def serve(
    router: Router,
    host: str,
    port: int,
    stop: asyncio.Event,
    *,
    reuse_port: bool = False,
    on_listening: Callable[[int], None] = lambda port: None,
) -> None:
    """Start `router`, serve on host:port until `stop` is set, let answers in flight finish (up to
    GRACEFUL_SHUTDOWN_S), then stop the router."""
    await router.start()
    # What exists now (modules, schemas, the fleet) lives as long as the process: out of the collector's
    # sight, a full collection no longer walks it, which would stall every request in flight for milliseconds.
    gc.collect()
    gc.freeze()
    loop = asyncio.get_running_loop()
    try:
        server = await loop.create_server(
            router.protocol, host, port, reuse_port=reuse_port or None, backlog=BACKLOG
        )
        on_listening(server.sockets[0].getsockname()[1])
        await stop.wait()
        server.close()
        await _drain(router)
        for conn in list(router.connections):
            conn.close()
    finally:
        await router.stop()


async def _drain(router: Router) -> None:
    deadline = asyncio.get_running_loop().time() + GRACEFUL_SHUTDOWN_S
    while any(conn.busy for conn in router.connections) and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)


def run(config: RouterConfig, fleet: Fleet, host: str, port: int, workers: int = 1) -> int:
    if workers <= 1:
        uvloop.run(_serve_until_signalled(config, fleet, host, port, reuse_port=False))
        return 0
    if port == 0:
        raise ValueError("--workers needs a fixed --port: every worker binds the same one")
    with socket.socket() as probe:  # fail here, once, if the port is taken
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        probe.bind((host, port))
    return _supervise([_fork_worker(config, fleet, host, port) for _ in range(workers)])


async def _serve_until_signalled(
    config: RouterConfig, fleet: Fleet, host: str, port: int, reuse_port: bool
) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await serve(Router(config, fleet), host, port, stop, reuse_port=reuse_port)


def _fork_worker(config: RouterConfig, fleet: Fleet, host: str, port: int) -> int:
    pid = os.fork()
    if pid:
        return pid
    code = 0
    try:
        uvloop.run(_serve_until_signalled(config, fleet, host, port, reuse_port=True))
    except BaseException:
        logger.exception("router worker %d failed", os.getpid())
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _supervise(pids: list[int]) -> int:
    """Wait for the workers; SIGTERM and SIGINT go on to them. A worker that exits takes the others down
    with it, so that whatever supervises this process sees one router that stopped."""
    alive = set(pids)

    def forward(signum: int, frame: object) -> None:
        for pid in alive:
            os.kill(pid, signal.SIGTERM)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    code = 0
    while alive:
        pid, status = os.wait()
        alive.discard(pid)
        exit_code = os.waitstatus_to_exitcode(status)
        if exit_code != 0 and alive:
            logger.error("router worker %d exited (%d); stopping the others", pid, exit_code)
            forward(signal.SIGTERM, None)
        code = code or exit_code
    return code

"""`edgeinfer standby`: a process that has already imported torch, the engine and the server, and forks
`edgeinfer serve`, `generate` and `embed` for their clients, so a restart skips the imports.

Run it once per host and user (a terminal, or a service unit beside the node's); while its socket is there,
`edgeinfer serve` hands its command line to it and the forked child is the server. A client whose
interpreter, import path, installed packages, edgeinfer sources or environment differ from the standby's is
refused with a one-line reason and starts on its own, as it does when no standby runs, or with
`EDGEINFER_STANDBY=off`. The child takes its client's descriptors, working directory, environment, umask
and CPU affinity; it stays in the standby's cgroup and resource limits. Stopping the standby stops none of
its children.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import os
import selectors
import signal
import socket
import struct
import sys
import time
from pathlib import Path

from edgeinfer.cli.standby import child, wire

# What `serve`, `generate` and `embed` import before they can load a model; their children import only
# what a particular model needs on top.
WARM_MODULES = (
    "torch",
    "edgeinfer.node.cli",
    "edgeinfer.api.files",
    "edgeinfer.node.http.app",
    "edgeinfer.node.http.server",
    "edgeinfer.pool.loader",
    "edgeinfer.pool.manager",
    "edgeinfer.engine.async_engine",
    "edgeinfer.engine.loading",
    "edgeinfer.cli.generate",
    "edgeinfer.cli.embed",
)
WARM_TRANSFORMERS = ("AutoTokenizer", "PreTrainedTokenizerFast", "AutoConfig")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--socket",
        type=Path,
        default=None,
        help="the Unix socket to listen on (default: $EDGEINFER_STANDBY, else "
        "$XDG_RUNTIME_DIR/edgeinfer/standby.sock, else ~/.cache/edgeinfer/standby.sock)",
    )


def run(args: argparse.Namespace) -> int:
    path = args.socket or wire.socket_path()
    if path is None:
        raise ValueError(f"{wire.STANDBY_ENV}=off: give --socket to run a standby anyway")
    started = time.perf_counter()
    listener = _bind(path)  # first: a second standby on a live socket fails before seconds of imports
    try:
        _warm()  # a client that connects meanwhile waits in the backlog
        if sys.stderr is not None:
            print(f"edgeinfer standby: ready on {path} ({len(sys.modules)} modules, kernels loaded, "
                  f"{time.perf_counter() - started:.1f} s)", file=sys.stderr, flush=True)  # fmt: skip
        Standby(listener, wire.fingerprint()).serve_forever()
    finally:
        listener.close()
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
    return 0


def _warm() -> None:
    for name in WARM_MODULES:
        importlib.import_module(name)
    import transformers

    # transformers imports a name's module when the name is first read; a child reads these at every load
    for name in WARM_TRANSFORMERS:
        getattr(transformers, name)
    from edgeinfer.engine import kernels
    from edgeinfer.engine.prepared.key import code_fingerprint, cpu_fingerprint

    kernels.load()
    # what every prepared-form lookup hashes, once per process (the sources are the standby's: a client
    # whose sources differ is refused)
    code_fingerprint()
    cpu_fingerprint()
    # Out of the collector's sight from here on, in the standby and in every child: a child's collections
    # (the node runs a full one when it is ready) walk only what it made, and do not write to the pages
    # it shares with the standby.
    gc.collect()
    gc.freeze()


def _bind(path: Path) -> socket.socket:
    """Listen on `path`, replacing a socket file no standby answers on any more."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    if path.exists():
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
        except OSError:
            path.unlink()
        else:
            raise ValueError(f"a standby already listens on {path}")
        finally:
            probe.close()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)  # the socket is the owner's only
    try:
        listener.bind(str(path))
    finally:
        os.umask(old)
    listener.listen(64)
    return listener


class Standby:
    """One thread (a fork copies only the calling thread): select over the listener and a signal pipe,
    fork per accepted client, reap children and report those killed by a signal."""

    def __init__(self, listener: socket.socket, stamp: dict) -> None:
        self.listener = listener
        self.stamp = stamp
        self.children: dict[int, socket.socket] = {}
        self.wake_r, self.wake_w = os.pipe()
        self.selector = selectors.DefaultSelector()

    def serve_forever(self) -> None:
        for fd in (self.wake_r, self.wake_w):
            os.set_blocking(fd, False)
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so the wakeup fd hears of it
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        self.selector.register(self.listener, selectors.EVENT_READ)
        self.selector.register(self.wake_r, selectors.EVENT_READ)
        try:
            while True:
                for key, _ in self.selector.select():
                    if key.fileobj is self.listener:
                        self._accept()
                    else:
                        with contextlib.suppress(BlockingIOError):
                            os.read(self.wake_r, 512)
                        self._reap()
        except KeyboardInterrupt:
            pass
        finally:
            signal.set_wakeup_fd(-1)

    def _accept(self) -> None:
        conn, _ = self.listener.accept()
        conn.settimeout(5.0)  # a client that connects and says nothing must not hold the loop
        fds: list[int] = []
        try:
            request, fds = wire.receive_request(conn, 3)
            why = self._refusal(conn, request, fds)
            if why:
                wire.send(conn, {"refused": why})
            else:
                self._fork(conn, request, fds)
                return
        except (OSError, ValueError, KeyError, TypeError) as exc:
            if sys.stderr is not None:
                print(f"edgeinfer standby: a client's request failed: {exc}", file=sys.stderr, flush=True)
        finally:
            for fd in fds:
                os.close(fd)
        conn.close()

    def _refusal(self, conn: socket.socket, request: dict | None, fds: list[int]) -> str | None:
        _, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        if uid != os.getuid():
            return "another user's standby"
        if request is None or len(fds) != 3:
            return "the request came without its three standard descriptors"
        return wire.mismatch(self.stamp, request["fingerprint"])

    def _fork(self, conn: socket.socket, request: dict, fds: list[int]) -> None:
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:  # None: the standby was started with that descriptor closed
                stream.flush()
        pid = os.fork()
        if pid == 0:
            child.run(conn, request, fds, self._close_in_child)
        self.children[pid] = conn

    def _close_in_child(self) -> None:
        """What a child must not hold: the listener, the loop's descriptors, other clients' connections."""
        signal.set_wakeup_fd(-1)
        self.selector.close()
        self.listener.close()
        for other in self.children.values():
            other.close()
        os.close(self.wake_r)
        os.close(self.wake_w)

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.children.pop(pid, None)
            if conn is None:
                continue
            if os.WIFSIGNALED(status):  # a child that exited normally sent its own status
                with contextlib.suppress(OSError):
                    wire.send(conn, {"signal": os.WTERMSIG(status)})
            conn.close()

"""A forked child of the standby: it becomes its client's process (descriptors, directory, environment,
umask, CPU affinity, a session of its own), runs the command, and sends back its exit status."""

from __future__ import annotations

import atexit
import fcntl
import io
import logging
import os
import signal
import socket
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any, NoReturn

from edgeinfer.cli.standby import wire


def run(
    conn: socket.socket, request: dict[str, Any], fds: list[int], close_inherited: Callable[[], None]
) -> NoReturn:
    """Never returns into the standby's loop: every way out ends in os._exit."""
    code = 1
    try:
        os.setsid()  # the standby's signals and process group are not the command's
        close_inherited()
        _become(request, fds)
        conn.settimeout(None)
        # the pid goes first, from here, so that it always precedes this child's exit status
        wire.send(conn, {"pid": os.getpid()})
        _end_with_client(conn)
        code = _command(request["argv"])
    except BaseException:  # the child must not unwind into the standby's accept loop
        traceback.print_exc()
    _exit(conn, code)


def _become(request: dict[str, Any], fds: list[int]) -> None:
    for signum in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    _take_stdio(fds)
    _reopen_stdio()
    logging.root.handlers.clear()  # the standby's handlers hold its streams and its verbosity
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    os.umask(int(request["umask"]))
    os.sched_setaffinity(0, request["affinity"])
    sys.argv = [sys.argv[0], *request["argv"]]


def _take_stdio(fds: list[int]) -> None:
    """The client's descriptors as 0, 1 and 2. They may have arrived as 0-2 themselves (a standby started
    with its own closed), so each is first copied above 2."""
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3) for fd in fds]
    for fd in fds:
        if fd > 2:
            os.close(fd)
    for target, fd in enumerate(high):
        os.dup2(fd, target)
        os.close(fd)


def _reopen_stdio() -> None:
    """Streams built for the client's descriptors as Python builds them at start: a terminal's stdout is
    line-buffered, a pipe's is not; stderr always is."""
    sys.stdin = sys.__stdin__ = _stream(0, "r", line=False, like=sys.__stdin__)
    sys.stdout = sys.__stdout__ = _stream(1, "w", line=os.isatty(1), like=sys.__stdout__)
    sys.stderr = sys.__stderr__ = _stream(2, "w", line=True, like=sys.__stderr__)


def _stream(fd: int, mode: str, line: bool, like: io.TextIOWrapper | None) -> io.TextIOWrapper:
    """`like`: the standby's stream on `fd`, None where the standby started with `fd` closed."""
    unbuffered = mode == "w" and like is not None and like.write_through  # `python -u`, PYTHONUNBUFFERED
    raw = open(fd, mode + "b", buffering=0 if unbuffered else -1, closefd=False)  # noqa: SIM115 (the stream's)
    if like is not None:
        encoding, errors = like.encoding, like.errors
    else:  # Python's own choices for a standard stream
        encoding, errors = None, ("backslashreplace" if fd == 2 else None)
    return io.TextIOWrapper(
        raw, encoding=encoding, errors=errors, line_buffering=line, write_through=unbuffered
    )


def _end_with_client(conn: socket.socket) -> None:
    """The client sends nothing after its request: the connection's end means the client is gone (even
    killed with SIGKILL), and its command goes with it as a server does on SIGTERM."""

    def watch() -> None:
        try:
            while conn.recv(4096):
                pass
        except OSError:
            pass
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="standby-client", daemon=True).start()


def _command(argv: list[str]) -> int:
    from edgeinfer.cli import run_here

    try:
        return run_here(argv)
    except SystemExit as stop:  # argparse's errors and --help
        if stop.code is None or isinstance(stop.code, int):
            return stop.code or 0
        print(stop.code, file=sys.stderr)
        return 1


def _exit(conn: socket.socket, code: int) -> NoReturn:
    """End as the interpreter ends a process, in its order (its non-daemon threads joined, then the exit
    functions, then the streams flushed), then report the status; os._exit, since the frames below are
    the standby's loop."""
    try:
        threading._shutdown()  # type: ignore[attr-defined]  # what Py_FinalizeEx calls first
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        wire.send(conn, {"exit": code})
    finally:
        os._exit(code)

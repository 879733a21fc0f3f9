"""The client side: `edgeinfer serve` asks a running standby to fork the server, then stands in for it.

The client passes its argv, working directory, environment, umask, CPU affinity and its stdin, stdout and
stderr; it forwards the signals a user or a supervisor sends it (Ctrl-C, `kill`) to the child and exits
with the child's exit status, so to a shell or a supervisor it behaves as the server itself. The child ends
when its client does, even if the client is killed outright (the child watches the connection).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
from types import FrameType
from typing import BinaryIO

from edgeinfer.cli.standby import wire

_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
_TERMINATING = frozenset({signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGKILL, signal.SIGPIPE,
                          signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM})  # fmt: skip


def hand_off(argv: list[str]) -> int | None:
    """The command's exit status once a standby ran it; None when there is no standby to run it (the
    caller runs the command itself), after one line on stderr if a standby was there but unusable."""
    command = next((a for a in argv if not a.startswith("-")), None)
    path = wire.socket_path() if command in wire.HANDED_COMMANDS else None
    if path is None or not path.exists():
        return None
    request = _request(argv)  # before connecting: the standby gives a connection a few seconds to speak
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(str(path))
        wire.send(sock, request, [0, 1, 2])
        replies = sock.makefile("rb")
        first = wire.parse(replies.readline())
    except OSError as exc:  # a stale socket file, a standby that went away
        why = exc.strerror or exc
        print(f"edgeinfer: standby at {path} not used ({why}); starting here", file=sys.stderr)
        sock.close()
        return None
    if first is None or "pid" not in first:
        why = first.get("refused", "no answer") if first else "it hung up"
        print(f"edgeinfer: standby at {path} not used: {why}; starting here", file=sys.stderr)
        sock.close()
        return None
    return _wait(first["pid"], replies)


def _request(argv: list[str]) -> dict:
    umask = os.umask(0)
    os.umask(umask)
    return {
        "argv": argv,
        "cwd": os.getcwd(),
        "env": dict(os.environ),
        "umask": umask,
        "affinity": sorted(os.sched_getaffinity(0)),
        "fingerprint": wire.fingerprint(),
    }


def _end_like(signum: int) -> int:
    """Die of the signal that ended the child where it only terminates; a core-dumping one (SIGSEGV,
    SIGABRT) becomes the shell's 128 + N, so that the client leaves no core of its own."""
    if signum in _TERMINATING:
        with contextlib.suppress(OSError, ValueError):  # SIGKILL has no handler to reset
            signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
    return 128 + signum


def _wait(pid: int, replies: BinaryIO) -> int:
    """Forward signals to the child until its exit status arrives; a child killed by a signal kills its
    client with the same one, as a shell or a supervisor would have seen the server end. No status and a
    closed connection means the child died with its standby gone: nothing can say how, so 1."""

    def forward(signum: int, _frame: FrameType | None) -> None:
        with contextlib.suppress(ProcessLookupError):  # the child has just ended
            os.kill(pid, signum)

    for signum in _FORWARDED:
        signal.signal(signum, forward)
    while (message := wire.parse(replies.readline())) is not None:
        if "exit" in message:
            return int(message["exit"])
        if "signal" in message:
            return _end_like(int(message["signal"]))
    return 1

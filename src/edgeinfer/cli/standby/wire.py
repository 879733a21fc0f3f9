"""What a client and the standby share: where the socket is, what must match, and the framing.

Kept free of heavy imports: the client runs this before anything else in `edgeinfer serve`.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import sys
from pathlib import Path
from typing import Any

STANDBY_ENV = "EDGEINFER_STANDBY"  # a socket path, or "off"
# Commands a standby runs: the ones whose start is mostly importing torch and the engine.
HANDED_COMMANDS = frozenset({"serve", "generate", "embed"})
# Variables that differ between two shells, terminals, logins or service units without changing what a
# process imports: a standby in one SSH session serves a `serve` typed in another.
_IGNORED_ENV = frozenset(
    {"_", "PWD", "OLDPWD", "SHLVL", "COLUMNS", "LINES", "COLORTERM", "LS_COLORS", "WINDOWID", "STY",
     "MOTD_SHOWN", "XDG_VTNR", STANDBY_ENV, "INVOCATION_ID", "JOURNAL_STREAM", "SYSTEMD_EXEC_PID",
     "MANAGERPID", "LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"}
)  # fmt: skip
_IGNORED_ENV_PREFIXES = ("SSH_", "XDG_SESSION_", "TERM", "TMUX")
# What else must be equal, and how a refusal names it.
_CHECKED = (
    ("python", "the interpreter"),
    ("uid", "the user"),
    ("path", "the import path or its packages"),
    ("code", "edgeinfer's code"),
)
_CODE_SUFFIXES = (".py", ".cpp", ".h")
MAX_MESSAGE = 1 << 22


def socket_path() -> Path | None:
    """`$EDGEINFER_STANDBY`, else `$XDG_RUNTIME_DIR/edgeinfer/standby.sock`, else the cache root's
    `standby.sock`; None when the variable says `off`."""
    value = os.environ.get(STANDBY_ENV, "")
    if value == "off":
        return None
    if value:
        return Path(value).expanduser()
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return Path(runtime) / "edgeinfer" / "standby.sock"
    from edgeinfer.engine.cache_dir import cache_root

    return cache_root() / "standby.sock"


def fingerprint() -> dict[str, Any]:
    """What a forked child inherits from the standby rather than from its client, so it must be equal:
    the interpreter, the import path and what lies on it, our code, and the environment the imports read."""
    import edgeinfer

    return {
        "python": [sys.executable, sys.version],
        # sys.path[0] is the script's or the working directory: it decides nothing the standby imported
        "path": [[p, _mtime(p)] for p in sys.path[1:]],
        "code": code_stamp(Path(edgeinfer.__file__).parent),
        "env": comparable_env(dict(os.environ)),
        "uid": os.getuid(),
    }


def comparable_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k not in _IGNORED_ENV and not k.startswith(_IGNORED_ENV_PREFIXES)}


def mismatch(ours: dict[str, Any], theirs: dict[str, Any]) -> str | None:
    """One line naming what differs, or None."""
    if ours["env"] != theirs["env"]:
        keys = set(ours["env"]) ^ set(theirs["env"])
        keys |= {k for k in set(ours["env"]) & set(theirs["env"]) if ours["env"][k] != theirs["env"][k]}
        return f"the environment differs ({', '.join(sorted(keys)[:5])})"
    for key, what in _CHECKED:
        if ours[key] != theirs[key]:
            return f"{what} changed since the standby started"
    return None


def code_stamp(package: Path) -> str:
    """Names, sizes and modification times of our sources: an edit after the standby imported them
    makes its children stale."""
    digest = hashlib.sha1()
    for root, dirs, files in os.walk(package):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            if name.endswith(_CODE_SUFFIXES):
                st = os.stat(os.path.join(root, name))
                digest.update(f"{root}/{name}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def _mtime(path: str) -> int:
    """A directory's mtime moves when an entry is added or removed (a package installed or removed)."""
    try:
        return os.stat(path or ".").st_mtime_ns
    except OSError:
        return 0


def send(sock: socket.socket, message: dict[str, Any], fds: list[int] | None = None) -> None:
    """One message: a line of JSON, with descriptors riding on its first bytes."""
    frame = json.dumps(message).encode() + b"\n"
    sent = socket.send_fds(sock, [frame], fds) if fds else 0
    if sent < len(frame):  # sending nothing to a peer that has answered and hung up would fail (EPIPE)
        sock.sendall(frame[sent:])


def receive_request(sock: socket.socket, max_fds: int) -> tuple[dict[str, Any] | None, list[int]]:
    """The one message a client sends and the descriptors with it; (None, []) if it hung up first."""
    data, fds, _, _ = socket.recv_fds(sock, 65536, max_fds)
    while data and not data.endswith(b"\n"):
        if len(data) > MAX_MESSAGE:
            raise ValueError(f"standby request over {MAX_MESSAGE} bytes")
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("standby request cut short")
        data += chunk
    return (json.loads(data) if data else None), fds


def parse(line: bytes) -> dict[str, Any] | None:
    """A line read from a connection; None at its end."""
    return json.loads(line) if line else None

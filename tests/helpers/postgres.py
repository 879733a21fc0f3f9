"""A throwaway PostgreSQL cluster for tests and benchmarks: `initdb` into a temporary directory, the server
listening on a unix socket there only (no port to collide on), trust authentication; removed at the end.
The server binaries are Debian's (`apt-get install postgresql` puts them in /usr/lib/postgresql/N/bin)."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

# initdb and postgres refuse to run as root; as root, they run as this user.
UNPRIVILEGED = "nobody"


def postgres_bindir() -> Path | None:
    """Where `initdb` and `pg_ctl` are: on PATH, else the newest Debian version; None if not installed."""
    found = shutil.which("initdb")
    if found:
        return Path(found).resolve().parent
    versions = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda p: int(p.parts[-3]))
    return versions[-1].parent if versions else None


@dataclass(frozen=True)
class PostgresCluster:
    url: str  # its `postgres` database, as superuser `postgres`
    pg_ctl: tuple[str, ...]  # pg_ctl with the cluster's directory, log and server options

    def restart(self) -> None:
        """Stop the server as a crash would (no shutdown checkpoint: its clients are cut off) and start it."""
        _run([*self.pg_ctl, "-m", "immediate", "-w", "restart"])


@contextmanager
def throwaway_postgres(fsync: bool = False) -> Iterator[PostgresCluster]:
    """A running cluster. `fsync=False` for tests (nothing to keep); a benchmark measures with the default,
    durable commits."""
    bindir = postgres_bindir()
    if bindir is None:
        raise FileNotFoundError("PostgreSQL server binaries not found (Debian: apt-get install postgresql)")
    root = Path(tempfile.mkdtemp(prefix="edgeinfer-pg-"))
    as_user: list[str] = []
    if os.geteuid() == 0:
        user = pwd.getpwnam(UNPRIVILEGED)
        os.chown(root, user.pw_uid, user.pw_gid)
        as_user = ["runuser", "-u", UNPRIVILEGED, "--"]
    data = str(root / "data")
    _run([*as_user, str(bindir / "initdb"), "-D", data, "-U", "postgres", "--auth=trust", "--no-sync"])
    options = f"-c listen_addresses='' -c unix_socket_directories={root} -c fsync={'on' if fsync else 'off'}"
    pg_ctl = (*as_user, str(bindir / "pg_ctl"), "-D", data, "-l", str(root / "server.log"), "-o", options)
    _run([*pg_ctl, "-w", "start"])
    try:
        yield PostgresCluster(f"postgresql://postgres@/postgres?host={root}", pg_ctl)
    finally:
        _run([*pg_ctl, "-m", "immediate", "-w", "stop"])
        shutil.rmtree(root, ignore_errors=True)


def fresh_database(cluster_url: str) -> str:
    """A new, empty database in the cluster; returns its URL."""
    import psycopg

    name = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(cluster_url, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    return cluster_url.replace("/postgres?", f"/{name}?")


def _run(cmd: list[str]) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout}{done.stderr}")

"""Run `edgeinfer` as a new user does: a fresh process of the installed command, an empty home (so empty
caches: prepared models, usage database, anything else kept under `~`), run from that home.

The test process has imported transformers, built models and filled caches long before; a bug that only
shows in a cold process (an import race between two threads, a cache that is assumed to exist) is invisible
to in-process tests and is what these helpers are for.

One thing is kept from the test session: the build directory of our CPU kernels (`TORCH_EXTENSIONS_DIR`,
which tests/conftest.py points at the user's build cache). A first build takes minutes of compiling on a
small machine, is keyed by the kernels' source, and is not what a CLI test checks.

Each process is pinned to one core, taken from a pool of this machine's cores, so that commands run side by
side without their thread pools contending (an engine takes every core it may run on); a process that sees
one core behaves as it would on a one-core machine.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx

# The console script that `pip install` puts beside the interpreter, as a user runs it.
_SCRIPT = Path(sys.executable).with_name("edgeinfer")
EDGEINFER = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "edgeinfer.cli"]

# Variables that point a process at caches the test session (or the developer) has already filled.
_CACHE_VARIABLES = ("XDG_CACHE_HOME", "XDG_STATE_HOME", "XDG_DATA_HOME", "HF_HOME", "HF_HUB_CACHE")


def new_user_env(home: Path) -> dict[str, str]:
    """This process's environment with `home` as HOME and no cache locations inherited."""
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith("EDGEINFER_CACHE") and key not in _CACHE_VARIABLES
    }
    env["HOME"] = str(home)
    from edgeinfer.engine.cache_dir import cache_root

    env["TORCH_EXTENSIONS_DIR"] = os.environ.get("TORCH_EXTENSIONS_DIR") or str(cache_root() / "extensions")
    return env


class _Cores:
    """This machine's cores, one per running command."""

    def __init__(self) -> None:
        self._free: queue.Queue[int] = queue.Queue()
        for core in sorted(os.sched_getaffinity(0)):
            self._free.put(core)
        self.count = self._free.qsize()

    @contextlib.contextmanager
    def one(self) -> Iterator[int]:
        core = self._free.get()
        try:
            yield core
        finally:
            self._free.put(core)


CORES = _Cores()


def _start(args: Sequence[str], home: Path, core: int, **popen: Any) -> subprocess.Popen[Any]:
    """Start `edgeinfer ARGS` on `core`: the calling thread is pinned to it while it forks, since a child
    inherits its thread's affinity (Linux keeps one per thread), and then unpinned; nothing has to run in
    the child between fork and exec, as `preexec_fn` would."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {core})
    try:
        return subprocess.Popen([*EDGEINFER, *args], env=new_user_env(home), cwd=home, **popen)
    finally:
        os.sched_setaffinity(0, before)


def new_home(root: Path) -> Path:
    home = root / "home"
    home.mkdir(parents=True)
    return home


def run_edgeinfer(args: Sequence[str], home: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """`edgeinfer ARGS` in a fresh process as a new user with `home`; the output captured."""
    with CORES.one() as core:
        proc = _start(args, home, core, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def describe(res: subprocess.CompletedProcess[str]) -> str:
    command = " ".join(map(str, res.args))
    return f"{command}: exit {res.returncode}\nstdout: {res.stdout}\nstderr: {res.stderr[-4000:]}"


def assert_succeeded(res: subprocess.CompletedProcess[str]) -> None:
    assert res.returncode == 0 and "Traceback" not in res.stderr, describe(res)


def assert_one_line_error(res: subprocess.CompletedProcess[str], verb: str, says: str) -> None:
    """A usage mistake: a non-zero exit, nothing on stdout, one line on stderr naming the command and
    saying `says`, and no traceback."""
    assert res.returncode != 0 and res.stdout == "" and "Traceback" not in res.stderr, describe(res)
    errors = [line for line in res.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith(f"edgeinfer {verb}: error:"), describe(res)
    assert says in errors[0], describe(res)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def serving(args: Sequence[str], home: Path, ready_timeout: float = 300) -> Iterator[str]:
    """`edgeinfer serve ARGS` on a free loopback port as a new user; yields its base URL once /ready says
    so, then stops it with SIGTERM (as a service manager does) and checks that it shut down cleanly."""
    port = free_port()
    log_path = home / "serve.log"
    serve = ["serve", *args, "--host", "127.0.0.1", "--port", str(port)]
    with CORES.one() as core, open(log_path, "wb") as log:
        proc = _start(serve, home, core, stdout=log, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}"
            _wait_ready(proc, url, log_path, ready_timeout)
            yield url
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                code = proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
                raise
    text = log_path.read_text(errors="replace")
    # uvicorn shuts down on SIGTERM and then raises it again, so a clean stop may end by the signal.
    clean = code in (0, -signal.SIGTERM) and "Application shutdown complete" in text
    assert clean and "Traceback" not in text, f"serve exited {code}:\n{text[-3000:]}"


def _wait_ready(proc: subprocess.Popen[bytes], url: str, log_path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"serve exited {proc.returncode}:\n{log_path.read_text()[-3000:]}")
        try:
            if httpx.get(url + "/ready", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"serve not ready in {timeout:.0f} s:\n{log_path.read_text()[-3000:]}")
        time.sleep(0.2)

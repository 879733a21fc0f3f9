"""How many threads the engine's ops use.

The default is every core the process may run on (its CPU affinity, so a container's or `taskset`'s limit
counts). A decode step is bound by how fast the weights stream from memory; on the CPUs measured one
core does not saturate the memory bus, so the bandwidth-bound products (the lm_head above all) gain
from a second thread, and our kernels split only products big enough to repay it (kernels/bf16_gemv.cpp).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys

import torch

_PR_SET_NAME = 15  # prctl(2)


def available_cores() -> int:
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def use_threads(threads: int | None) -> int:
    """Set torch's intra-op thread count (None: every available core); returns it. Threads that run
    ops later (the async engine's step loop) take the same count when they first run one."""
    n = threads or available_cores()
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n


def name_os_thread(name: str) -> None:
    """Give the calling thread an OS-level name (Linux; at most 15 bytes), so `top -H`, /proc and profilers
    tell it apart; the OpenMP workers it starts later inherit the name. Python's thread names stay
    inside the interpreter."""
    if not sys.platform.startswith("linux"):
        return
    # No libc symbol to call is no error: the name is only a convenience.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)

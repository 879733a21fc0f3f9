"""Threads: how many the engine's ops use (runtime.py sets it), OS names, one-off work in a thread.

The default thread count is every core the process may run on (its CPU affinity, so a container's or
`taskset`'s limit counts). A decode step is bound by how fast the weights stream from memory; on the
CPUs measured one core does not saturate the memory bus, so the bandwidth-bound products (the lm_head
above all) gain from a second thread, and our kernels split only products big enough to repay it
(kernels/bf16_gemv.cpp).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import sys
import threading
from collections.abc import Callable
from typing import TypeVar

_PR_SET_NAME = 15  # prctl(2)
T = TypeVar("T")


def available_cores() -> int:
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def name_os_thread(name: str) -> None:
    """Give the calling thread an OS-level name (Linux; at most 15 bytes), so `top -H`, /proc and profilers
    tell it apart; the OpenMP workers it starts later inherit the name. Python's thread names stay
    inside the interpreter."""
    if not sys.platform.startswith("linux"):
        return
    # No libc symbol to call is no error: the name is only a convenience.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)


async def run_in_own_thread(fn: Callable[[], T], name: str = "edgeinfer-load") -> T:
    """`fn()` in a new thread that ends with it, awaited from the event loop.

    OpenMP keeps a team of worker threads for every thread that ran a parallel op, for as long as that
    thread lives; while more OpenMP threads exist than cores, libgomp's workers stop spinning between
    parallel regions and sleep, so every region of a decode step pays two futex wake-ups, which makes a
    served stream visibly slower than the same engine stepped in-process. The default executor's threads
    outlive their work, so a model loaded there would leave its team behind; one-off torch work (loading
    a model) runs here instead and takes its team with it.
    """
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if done.cancelled():
            return
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(result)  # type: ignore[arg-type]

    def target() -> None:
        try:
            result = fn()
        except BaseException as e:  # handed to the awaiting task, as asyncio.to_thread does
            loop.call_soon_threadsafe(settle, None, e)
        else:
            loop.call_soon_threadsafe(settle, result, None)

    threading.Thread(target=target, name=name, daemon=True).start()
    return await done

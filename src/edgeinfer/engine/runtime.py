"""The process's runtime: the settings every engine of a process shares, made once at start.

torch's thread count is one number per process, which CPU features our kernels use is one fact per
machine, and so is the layout of torch's int4 packing; a per-engine setting would only pretend otherwise.
The process's entry point (`serve`, `generate`, `eval`) starts the runtime from its flags before any
model loads; an engine built where none was started (a library user, a test) starts the default. Engines
read the runtime and pass what their layers need to them when they are built.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import torch

from edgeinfer.engine.kernels import cpu_flags
from edgeinfer.engine.kernels.limits import KernelLimits
from edgeinfer.engine.threads import available_cores

if TYPE_CHECKING:
    from edgeinfer.engine.quant.int4 import PackLayout


@dataclass(frozen=True, kw_only=True)
class Runtime:
    """`threads`: torch's intra-op threads (ours too); `kernels`: which products and ops take our
    kernels on this CPU."""

    threads: int
    kernels: KernelLimits

    @cached_property
    def int4_pack(self) -> PackLayout | None:
        """How torch's CPU int4 packing lays out its nibbles (it depends on the vector width), or None when
        it is none of the known forms. Probed on first use with a few small ops: not at start, which may
        run on the server's event-loop thread, where a parallel op would leave an OpenMP team beside the
        engine's (threads.py: `run_in_own_thread`); afterwards a plain attribute that compiled code
        reads rather than traces."""
        from edgeinfer.engine.quant.int4 import probe_pack_layout

        return probe_pack_layout()


_lock = threading.Lock()
_current: Runtime | None = None


def start_runtime(threads: int | None = None, kernels: KernelLimits | None = None) -> Runtime:
    """Make the process's runtime and apply it: `threads` None is every core this process may run on
    (threads.py says why), `kernels` None the limits of this CPU. Threads that run ops later (an async
    engine's step loop) take the same thread count when they first run one. A second call replaces the
    runtime for the whole process (engines built before keep the kernel limits they were built with)."""
    global _current
    if threads is not None and threads < 1:
        raise ValueError("threads must be >= 1")
    made = Runtime(
        threads=threads or available_cores(), kernels=kernels or KernelLimits.for_flags(cpu_flags())
    )
    with _lock:
        if torch.get_num_threads() != made.threads:
            torch.set_num_threads(made.threads)
        _current = made
    return made


def runtime() -> Runtime:
    """The process's runtime; the default one where the entry point started none."""
    return _current if _current is not None else start_runtime()

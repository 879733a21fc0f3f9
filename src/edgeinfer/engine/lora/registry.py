"""The engine's adapters by name: registered from a directory (checked in full at registration), kept
resident under a memory budget (least recently used first out, pinned ones never, nor one that a
request still uses), reloaded on demand, and bound to the requests that name them."""

from __future__ import annotations

import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from edgeinfer.engine.errors import EngineInputError
from edgeinfer.engine.lora.apply import LoraRuntime, kernel_available
from edgeinfer.engine.lora.config import AdapterError
from edgeinfer.engine.lora.step import StepPlan
from edgeinfer.engine.lora.targets import BaseTargets, base_targets
from edgeinfer.engine.lora.weights import LoraWeights, load_adapter
from edgeinfer.engine.scheduler import ScheduledChunk

log = logging.getLogger(__name__)

# Issue 49: Workers AI takes adapter files under 300 MB.
DEFAULT_MAX_FILE_BYTES = 300 * 1000 * 1000
DEFAULT_BUDGET_BYTES = 1 << 30
# No ':' (the API names an adapter as `base:adapter`), no '/' (a path).
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class UnknownAdapterError(EngineInputError):
    """A request names an adapter that is not registered (the node answers 404)."""


@dataclass
class _Entry:
    path: Path
    pinned: bool
    fingerprint: str
    weights: LoraWeights | None  # None while evicted
    users: int = 0


class AdapterRegistry:
    """Thread-safe: the server may register adapters while the engine thread steps."""

    def __init__(
        self,
        model: nn.Module,
        dtype: torch.dtype,
        budget_bytes: int = DEFAULT_BUDGET_BYTES,
        max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    ) -> None:
        self._model = model
        self._targets: BaseTargets | None = None  # on first registration: a MoE model fails there
        self.dtype = dtype
        self.budget_bytes = budget_bytes
        self.max_file_bytes = max_file_bytes
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first
        self._bound: dict[str, str] = {}  # request id -> adapter name
        self._lock = threading.Lock()
        self.runtime: LoraRuntime | None = None

    # ---- registration ----------------------------------------------------------------------------
    def register(self, name: str, path: str | Path, pin: bool = False) -> LoraWeights:
        """Load and check the adapter in `path` under `name` (AdapterError on any problem); replacing a
        name is refused while requests use it."""
        if not _NAME.match(name):
            raise AdapterError(f"adapter name {name!r} must be 1-128 letters, digits or ._- (no ':' or '/')")
        weights = self._load(name, Path(path))
        if weights.nbytes > self.budget_bytes:
            raise AdapterError(
                f"adapter is {weights.nbytes} bytes, over the adapters' budget {self.budget_bytes}"
            )
        with self._lock:
            old = self._entries.get(name)
            if old is not None and old.users:
                raise AdapterError(f"adapter {name!r} is in use by {old.users} requests")
            self._entries[name] = _Entry(Path(path), pin, weights.fingerprint, weights)
            self._entries.move_to_end(name)
            self._evict(keep=name)
            self._runtime()  # its hooks go on in the engine's thread, at the next step (begin_step)
        log.info("adapter %s: rank %d, %.1f MiB", name, weights.config.rank, weights.nbytes / 2**20)
        return weights

    def unregister(self, name: str) -> None:
        with self._lock:
            entry = self._entries.get(name)
            if entry is None:
                raise UnknownAdapterError(f"adapter {name!r} does not exist")
            if entry.users:
                raise AdapterError(f"adapter {name!r} is in use by {entry.users} requests")
            del self._entries[name]

    def has(self, name: str) -> bool:
        return name in self._entries

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._entries)

    def resident(self) -> list[str]:
        with self._lock:
            return sorted(n for n, e in self._entries.items() if e.weights is not None)

    def resident_bytes(self) -> int:
        with self._lock:
            return self._resident_bytes()

    def _resident_bytes(self) -> int:
        return sum(e.weights.nbytes for e in self._entries.values() if e.weights is not None)

    # ---- requests --------------------------------------------------------------------------------
    def acquire(self, request_id: str, name: str) -> str:
        """Bind the request to the adapter (loading it if evicted); returns its fingerprint, which the
        request's prefix-cache namespace takes."""
        with self._lock:
            entry = self._entries.get(name)
            if entry is None:
                raise UnknownAdapterError(f"adapter {name!r} does not exist")
            if entry.weights is None:
                try:  # its files were checked at registration; one changed since fails this request
                    entry.weights = self._load(name, entry.path)
                except AdapterError as e:
                    raise EngineInputError(f"adapter {name!r} cannot be reloaded: {e}") from None
                entry.fingerprint = entry.weights.fingerprint
            entry.users += 1
            self._bound[request_id] = name
            self._entries.move_to_end(name)
            self._evict(keep=name)
            return entry.fingerprint

    def release(self, request_ids: list[str]) -> None:
        """The requests finished: their adapters may be evicted again."""
        with self._lock:
            for rid in request_ids:
                name = self._bound.pop(rid, None)
                if name is not None and name in self._entries:
                    self._entries[name].users -= 1
            self._evict()

    def begin_step(self, chunks: Sequence[ScheduledChunk]) -> StepPlan | None:
        """For the runner: group the step's rows (`chunks` in flat-batch order, each chunk's tokens
        contiguous) by adapter; the step's plan, which the hooks (and the fused decode step) apply, or
        None when no row has an adapter (then no hook adds anything)."""
        if self.runtime is None:
            return None
        groups: dict[str, tuple[LoraWeights, list[tuple[int, int]]]] = {}
        row = 0
        with self._lock:
            # Hooks change only here, in the thread that runs the model: a module's hooks are a dict its
            # forward iterates. None at all while no adapter is registered.
            if self._entries and not self.runtime.installed:
                self.runtime.install()
            elif not self._entries and self.runtime.installed:
                self.runtime.remove()
            for c in chunks:
                name = self._bound.get(c.request_id)
                if name is not None:
                    weights = self._entries[name].weights
                    assert weights is not None  # a bound adapter is never evicted
                    groups.setdefault(name, (weights, []))[1].append((row, row + c.num_tokens))
                row += c.num_tokens
        return self.runtime.begin(groups)

    # ---- internals -------------------------------------------------------------------------------
    def _load(self, name: str, path: Path) -> LoraWeights:
        return load_adapter(name, path, self._base(), self.dtype, self.max_file_bytes)

    def _base(self) -> BaseTargets:
        if self._targets is None:
            self._targets = base_targets(self._model)
        return self._targets

    def _runtime(self) -> LoraRuntime:
        if self.runtime is None:
            modules = self._base().modules(self._model)
            self.runtime = LoraRuntime(modules, self.dtype, kernel_available(self._model))
        return self.runtime

    def _evict(self, keep: str | None = None) -> None:
        """Drop least recently used weights until under budget; the budget is exceeded rather than a
        request refused when every resident adapter is pinned or in use."""
        for name, entry in list(self._entries.items()):
            if self._resident_bytes() <= self.budget_bytes:
                return
            if entry.weights is not None and not entry.pinned and not entry.users and name != keep:
                entry.weights = None
                log.info("adapter %s evicted (memory budget)", name)

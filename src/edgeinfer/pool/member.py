"""Pool members: a resident local engine or a connection to an external OpenAI-compatible engine.

Every member answers the same small protocol: `stats()` (its load, for admission, `/metrics` and the
fleet status) and `health()`; the node generates through the backend registered for the member's `kind`
(node/backends/registry.py), and a generation is aborted by closing its stream.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from edgeinfer.engine.async_engine import AsyncLLMEngine
    from edgeinfer.engine.embedding.async_embedder import AsyncEmbeddingEngine

GENERATE = "generate"
EMBED = "embed"


@dataclass(frozen=True)
class MemberStats:
    """A member's load at one moment. `seats`: requests it runs at once (None: unknown, an upstream that
    queues on its own); None elsewhere: not known for this member (left out of `/metrics`)."""

    num_running: int
    num_waiting: int
    kv_usage: float | None = None
    seats: int | None = None
    prefix_cache_queries: int | None = None
    prefix_cache_hits: int | None = None
    num_preemptions: int | None = None
    # Per tenant: cached (unreferenced) KV blocks it holds, and blocks evicted from it (local engines).
    cached_blocks_by_tenant: Mapping[str, int] = dataclasses.field(default_factory=dict)
    evicted_blocks_by_tenant: Mapping[str, int] = dataclasses.field(default_factory=dict)
    # Of num_running / num_waiting: batch-lane work (queued entries), which interactive requests go before.
    num_running_batch: int = 0
    num_waiting_batch: int = 0
    # Speculative decoding per draft source (local engines): tokens drafted, and of those accepted.
    spec_drafted_by_source: Mapping[str, int] = dataclasses.field(default_factory=dict)
    spec_accepted_by_source: Mapping[str, int] = dataclasses.field(default_factory=dict)


class PoolMember(abc.ABC):
    """A loaded member. `version` identifies the weights served (for canaries and model listings)."""

    name: str
    kind: str
    version: str

    @abc.abstractmethod
    def stats(self) -> MemberStats:
        """Current load; never blocks (read on every request and every scrape)."""

    @abc.abstractmethod
    def health(self) -> str | None:
        """None while the member can serve, else why it cannot."""

    @abc.abstractmethod
    def memory_bytes(self) -> int:
        """Bytes of node memory this member holds (0 for an upstream)."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Release everything; the member is unusable afterwards."""


class LocalMember(PoolMember):
    """An `AsyncLLMEngine` resident in this process."""

    kind = "local"

    def __init__(self, name: str, engine: AsyncLLMEngine, version: str, max_num_seqs: int) -> None:
        self.name = name
        self.engine = engine
        self.version = version
        self.max_num_seqs = max_num_seqs

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return int(self.engine.max_model_len)

    def memory_bytes(self) -> int:
        return int(self.engine.memory_bytes())

    def stats(self) -> MemberStats:
        s = self.engine.stats()  # takes no lock
        return MemberStats(
            s.num_running,
            s.num_waiting,
            s.kv_usage,
            self.max_num_seqs,
            s.prefix_cache_queries,
            s.prefix_cache_hits,
            s.num_preemptions,
            s.cached_blocks_by_tenant,
            s.evicted_blocks_by_tenant,
            num_running_batch=s.num_running_batch,
            num_waiting_batch=s.num_waiting_batch,
            spec_drafted_by_source=s.spec_drafted_by_source,
            spec_accepted_by_source=s.spec_accepted_by_source,
        )

    def health(self) -> str | None:
        return self.engine.health()

    async def close(self) -> None:
        await self.engine.shutdown()


class EmbeddingMember(PoolMember):
    """An `AsyncEmbeddingEngine` (an encoder model) resident in this process."""

    kind = "embedding"

    def __init__(self, name: str, engine: AsyncEmbeddingEngine, version: str) -> None:
        self.name = name
        self.engine = engine
        self.version = version

    def memory_bytes(self) -> int:
        return int(self.engine.memory_bytes())

    def stats(self) -> MemberStats:
        e = self.engine.stats()
        return MemberStats(e.num_running, e.num_waiting)

    def health(self) -> str | None:
        return None

    async def close(self) -> None:
        await self.engine.shutdown()

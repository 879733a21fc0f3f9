"""Pool members: a resident local engine or a connection to an external OpenAI-compatible engine."""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from edgeinfer.engine.async_engine import AsyncLLMEngine
    from edgeinfer.engine.embedding.async_embedder import AsyncEmbeddingEngine

GENERATE = "generate"
EMBED = "embed"


class PoolMember(abc.ABC):
    """A loaded member. `version` identifies the weights served (for canaries and model listings)."""

    name: str
    kind: str
    version: str

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

    async def close(self) -> None:
        await self.engine.shutdown()


class EmbeddingMember(PoolMember):
    """An `AsyncEmbeddingEngine` (an encoder model) resident in this process."""

    kind = "local"

    def __init__(self, name: str, engine: AsyncEmbeddingEngine, version: str) -> None:
        self.name = name
        self.engine = engine
        self.version = version

    def memory_bytes(self) -> int:
        return int(self.engine.memory_bytes())

    async def close(self) -> None:
        await self.engine.shutdown()

"""Turns a `MemberSpec` into a live pool member, and guesses its memory before loading."""

from __future__ import annotations

import abc
import asyncio
import dataclasses
import hashlib
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgeinfer.engine.checkpoint_files import read_weight_files
from edgeinfer.pool.member import EMBED, GENERATE, EmbeddingMember, LocalMember, PoolMember
from edgeinfer.pool.spec import LOCAL, MemberSpec, PublicPrefixes
from edgeinfer.pool.upstream import UpstreamMember

if TYPE_CHECKING:
    from edgeinfer.engine.config import EngineConfig


class MemberLoader(abc.ABC):
    """Loads members for the pool. `estimate_bytes` may be rough: the pool corrects it after the load."""

    @abc.abstractmethod
    def estimate_bytes(self, spec: MemberSpec) -> int: ...

    @abc.abstractmethod
    async def load(self, spec: MemberSpec) -> PoolMember: ...

    def task(self, spec: MemberSpec) -> str:
        """What the member serves: GENERATE (text) or EMBED (vectors). Known without loading it."""
        return GENERATE


class EngineLoader(MemberLoader):
    """Local members become `AsyncLLMEngine`s built from `engine_config` with the spec's checkpoint."""

    def __init__(
        self,
        engine_config: EngineConfig,
        upstream_timeout_s: float = 300.0,
        public_prefixes: Mapping[str, PublicPrefixes] | None = None,
    ) -> None:
        self._engine_config = engine_config
        self._upstream_timeout_s = upstream_timeout_s
        self._public = dict(public_prefixes or {})

    def estimate_bytes(self, spec: MemberSpec) -> int:
        """Weight files on disk plus the KV budget. Quantized files that the engine dequantizes load
        larger than this; the pool learns the true size after the first load."""
        if spec.kind != LOCAL:
            return 0
        weights = checkpoint_bytes(resolve_checkpoint_path(spec.target))
        return weights if self.task(spec) == EMBED else weights + self._kv_bytes()

    def task(self, spec: MemberSpec) -> str:
        if spec.kind != LOCAL:
            return GENERATE
        from edgeinfer.engine.embedding import is_embedding_model

        return EMBED if is_embedding_model(spec.target) else GENERATE

    async def load(self, spec: MemberSpec) -> PoolMember:
        if spec.kind != LOCAL:
            tokenizer = await asyncio.to_thread(_load_tokenizer, spec.tokenizer) if spec.tokenizer else None
            return await UpstreamMember.connect(spec.name, spec.target, self._upstream_timeout_s, tokenizer)
        if self.task(spec) == EMBED:
            return await self._load_embedding(spec)
        from edgeinfer.engine.async_engine import AsyncLLMEngine
        from edgeinfer.engine.threads import run_in_own_thread

        public = self._public.get(spec.name, PublicPrefixes())
        config = dataclasses.replace(
            self._engine_config,
            model=spec.target,
            public_prefixes=public.texts,
            public_system_prompts=public.system_prompts,
        )
        # from_config blocks for seconds (reading weights); a thread of its own keeps the event loop
        # serving and ends with the load, taking its OpenMP team with it (engine/threads.py)
        engine = await run_in_own_thread(lambda: AsyncLLMEngine.from_config(config))
        version = checkpoint_version(resolve_checkpoint_path(spec.target), config.quantization)
        return LocalMember(spec.name, engine, version, config.max_num_seqs)

    async def _load_embedding(self, spec: MemberSpec) -> PoolMember:
        from edgeinfer.engine.embedding.async_embedder import AsyncEmbeddingEngine
        from edgeinfer.engine.embedding.config import EmbeddingConfig
        from edgeinfer.engine.threads import run_in_own_thread

        config = EmbeddingConfig.from_engine_config(self._engine_config, spec.target)
        engine = await run_in_own_thread(lambda: AsyncEmbeddingEngine.from_config(config))
        version = checkpoint_version(engine.embedder.path, config.dtype)
        return EmbeddingMember(spec.name, engine, version)

    def _kv_bytes(self) -> int:
        return int(self._engine_config.kv_cache_memory_bytes)


def _load_tokenizer(target: str) -> Any:
    from edgeinfer.engine.model.loader import open_checkpoint
    from edgeinfer.engine.tokenizer import Tokenizer

    return Tokenizer.from_checkpoint(open_checkpoint(target))


def resolve_checkpoint_path(target: str) -> Path | None:
    """A filesystem path as given, or the file a model name (like `gemma-3-270m`) resolves to (None:
    neither). No header is read: sizing a model before its load must not parse it twice."""
    path = Path(target)
    if path.exists():
        return path
    try:
        from edgeinfer.engine.model.loader import checkpoint_location

        path = checkpoint_location(target)
    except (ImportError, ValueError, OSError):
        return None
    return path if path.exists() else None


def checkpoint_bytes(path: Path | None) -> int:
    """Bytes of weight files at `path` (a file or a checkpoint directory)."""
    return sum(f.stat().st_size for f in _weight_files(path))


def checkpoint_version(path: Path | None, quantization: str | None) -> str:
    """A short fingerprint of the weights served: names, sizes and mtimes of the weight files, and the
    quantization applied at load. Changes when a model is replaced in place, so canaries split by it."""
    digest = hashlib.sha256(str(quantization).encode())
    for f in _weight_files(path):
        stat = f.stat()
        digest.update(f"{f.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:12]


def _weight_files(path: Path | None) -> list[Path]:
    if path is None or not path.exists():
        return []
    return read_weight_files(path)

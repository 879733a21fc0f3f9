"""The engine settings every node test server runs with."""

from edgeinfer.engine.config import EngineConfig

# Small KV pools keep every engine a few hundred KiB; float32 keeps results deterministic.
TEST_ENGINE = EngineConfig(dtype="float32", batch_window_ms=0, block_size=4, kv_cache_memory_bytes=256 * 1024)

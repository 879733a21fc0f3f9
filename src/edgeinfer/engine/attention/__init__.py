"""Paged attention: KV storage (`storage.py`), per-step metadata (`metadata.py`) and backends behind the
`AttentionBackend` ABC (`backend.py`), named in `registry.py`; CPU now, a CUDA backend slots in beside.

Nothing is imported here, so reading the registry (the CLI, `EngineConfig`) needs no torch."""

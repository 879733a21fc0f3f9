from __future__ import annotations

import pytest

from edgeinfer.engine.config import EngineConfig
from edgeinfer.engine.engine import LLMEngine


def make_engine(model: str, **kw) -> LLMEngine:
    defaults = dict(
        dtype="float32", batch_window_ms=0, num_kv_blocks=256, block_size=4, max_num_batched_tokens=512
    )
    return LLMEngine(EngineConfig(model=model, **{**defaults, **kw}))


@pytest.fixture
def engine_factory():
    """Builds engines and checks, after the test, that every one of them is idle with zero leaked blocks."""
    made: list[LLMEngine] = []

    def factory(model: str, **kw) -> LLMEngine:
        made.append(make_engine(model, **kw))
        return made[-1]

    yield factory
    for eng in made:
        assert not eng.has_unfinished_requests()
        eng.check_integrity()
        assert eng.scheduler.kv.tables == {}

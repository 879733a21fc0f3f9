from __future__ import annotations

import pytest
import torch
from helpers.tiny_models import MOE_FAMILIES, make_tiny

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


@pytest.fixture(scope="module")
def one_torch_thread():
    """For modules of tiny models: on a shared 2-core machine a second intra-op thread mostly spin-waits."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory) -> dict[str, str]:
    """Tiny checkpoints of the mixture-of-experts families, by family."""
    root = tmp_path_factory.mktemp("moe")
    return {f: str(make_tiny(f, root / f)) for f in MOE_FAMILIES}

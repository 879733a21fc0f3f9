"""Many small concurrent requests share forward passes; results equal the synchronous embedder's."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch
from helpers.embeddings import varied_texts

from edgeinfer.engine.embedding.async_embedder import AsyncEmbeddingEngine
from edgeinfer.engine.embedding.embedder import Embedder
from edgeinfer.engine.errors import EngineInputError


@pytest.fixture
def engine(embedder_fp32: Embedder):
    # A wide window so that the burst below surely lands in it even on a loaded machine.
    config = embedder_fp32.config
    embedder_fp32.config = dataclasses.replace(config, batch_window_ms=200.0)
    engine = AsyncEmbeddingEngine(embedder_fp32)
    yield engine
    asyncio.run(engine.shutdown())
    embedder_fp32.config = config


def test_burst_shares_one_forward_pass(engine: AsyncEmbeddingEngine, embedder_fp32: Embedder) -> None:
    ids = embedder_fp32.tokenize(varied_texts()[:24])

    async def burst():
        return await asyncio.gather(*(engine.embed(f"r{i}", [x]) for i, x in enumerate(ids)))

    results = asyncio.run(burst())
    assert engine.stats().forward_passes == 1
    assert all(r.batch_sizes == [24] for r in results)
    torch.testing.assert_close(
        torch.cat([torch.from_numpy(r.vectors) for r in results]), embedder_fp32.embed(ids), atol=2e-6, rtol=0
    )
    assert [r.num_tokens for r in results] == [len(x) for x in ids]


def test_cancelled_request_is_dropped(engine: AsyncEmbeddingEngine, embedder_fp32: Embedder) -> None:
    ids = embedder_fp32.tokenize(["one", "two"])

    async def cancel_one():
        task = asyncio.create_task(engine.embed("gone", [ids[0]]))
        await asyncio.sleep(0.01)
        task.cancel()
        return await engine.embed("kept", [ids[1]])

    kept = asyncio.run(cancel_one())
    assert kept.batch_sizes == [1]  # the cancelled input never joined the pass
    assert engine.stats().num_waiting == 0


def test_inputs_the_model_cannot_embed(engine: AsyncEmbeddingEngine) -> None:
    for inputs, message in [
        ([], "send at least one input"),
        ([[]], "empty list of token ids"),
        ([[101] * 300], "maximum input length is 256"),
        ([[30522]], "vocabulary"),
    ]:
        with pytest.raises(EngineInputError, match=message):
            asyncio.run(engine.embed("bad", inputs))

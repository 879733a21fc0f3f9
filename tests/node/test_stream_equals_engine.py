"""The server's token path changes nothing: a streamed completion is the engine's own offline output."""

from __future__ import annotations

import dataclasses

import openai
import pytest
from helpers.node_engine import TEST_ENGINE

from edgeinfer.engine.engine import LLMEngine
from edgeinfer.types import SamplingParams
from edgeinfer.types.sampling import choice_seed

PROMPT = "Streams of tokens"
SEED = 7
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def offline(tiny_llama_dir: str) -> tuple[LLMEngine, list[int]]:
    engine = LLMEngine(dataclasses.replace(TEST_ENGINE, model=tiny_llama_dir))
    return engine, engine.tokenizer.encode(PROMPT, add_special_tokens=True)


def _streamed(shared_node, n: int) -> list[str]:
    client = openai.OpenAI(base_url=shared_node.url + "/v1", api_key="unused", max_retries=0)
    stream = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=1.0, seed=SEED, n=n, stream=True
    )
    texts = [""] * n
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    return texts


@pytest.mark.parametrize("n", [1, 3])  # one choice reads its engine stream directly, several are merged
def test_streamed_text_is_the_engines_offline_text_for_the_same_seed(shared_node, offline, n: int) -> None:
    engine, ids = offline
    params = [
        SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=choice_seed(SEED, i)) for i in range(n)
    ]
    expected = [c.text for c in engine.generate([ids] * n, params)]
    assert len(set(expected)) == n  # sampled with different seeds, so a mixed-up merge would show
    assert _streamed(shared_node, n) == expected

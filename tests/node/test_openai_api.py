"""The official openai SDK against a real node on loopback (tiny random model)."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest


@pytest.fixture(scope="module")
def client(shared_node) -> openai.OpenAI:
    return openai.OpenAI(base_url=shared_node.url + "/v1", api_key="unused", max_retries=0)


def test_completion_sync(client: openai.OpenAI) -> None:
    out = client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=5, temperature=0)
    assert out.object == "text_completion"
    assert out.choices[0].finish_reason in ("length", "stop")
    assert out.usage.completion_tokens == 5 or out.choices[0].finish_reason == "stop"
    assert out.usage.prompt_tokens > 0
    again = client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=5, temperature=0)
    assert again.choices[0].text == out.choices[0].text  # greedy is deterministic


def test_chat_sync_with_alias(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model="@cf/test/tiny",
        messages=[{"role": "user", "content": "Hello"}],
        max_tokens=4,
        temperature=0,
    )
    assert out.model == "@cf/test/tiny"
    assert out.choices[0].message.role == "assistant"
    assert isinstance(out.choices[0].message.content, str)
    assert out.usage.completion_tokens <= 4
    assert out.usage.prompt_tokens_details.cached_tokens >= 0


def test_chat_async(shared_node) -> None:
    async def main() -> list[str]:
        client = openai.AsyncOpenAI(base_url=shared_node.url + "/v1", api_key="unused", max_retries=0)
        calls = [
            client.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": f"count {i}"}],
                max_tokens=3,
                temperature=0,
            )
            for i in range(4)
        ]
        results = await asyncio.gather(*calls)
        await client.close()
        return [r.choices[0].message.content for r in results]

    texts = asyncio.run(main())
    assert len(texts) == 4 and all(isinstance(t, str) for t in texts)


def test_streaming_matches_non_streaming(client: openai.OpenAI) -> None:
    kwargs = dict(model="tiny", prompt="Paged attention stores", max_tokens=6, temperature=0)
    whole = client.completions.create(**kwargs)
    stream = client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    pieces, usage, finish = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.text)
            finish = choice.finish_reason or finish
    assert "".join(pieces) == whole.choices[0].text
    assert finish == whole.choices[0].finish_reason
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens


def test_chat_streaming(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=5, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    whole = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=5, temperature=0
    )
    assert text == whole.choices[0].message.content


def test_echo_with_logprobs_returns_prompt_logprobs(client: openai.OpenAI, shared_node) -> None:
    prompt = "Continuous batching lets"
    out = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=2
    )
    choice = out.choices[0]
    assert choice.text.startswith(prompt)
    lp = choice.logprobs
    n_prompt = out.usage.prompt_tokens
    assert len(lp.tokens) == n_prompt + out.usage.completion_tokens
    assert lp.token_logprobs[0] is None  # nothing precedes the first prompt token
    assert all(v is not None and v <= 0.0 for v in lp.token_logprobs[1:])
    assert lp.top_logprobs[0] is None
    assert all(len(top) >= 1 for top in lp.top_logprobs[1:])
    assert lp.text_offset == sorted(lp.text_offset)


def test_n_choices_with_seed_are_reproducible(client: openai.OpenAI) -> None:
    kwargs = dict(model="tiny", prompt="Hello", max_tokens=6, temperature=1.0, n=3, seed=7, logprobs=0)
    first = client.completions.create(**kwargs)
    second = client.completions.create(**kwargs)
    assert sorted(c.index for c in first.choices) == [0, 1, 2]
    texts = [c.text for c in sorted(first.choices, key=lambda c: c.index)]
    assert texts == [c.text for c in sorted(second.choices, key=lambda c: c.index)]
    assert len(set(texts)) > 1  # choice i samples with seed + i, not three copies of one stream
    assert first.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in first.choices)


def test_best_of_must_equal_n(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="best_of"):
        client.completions.create(model="tiny", prompt="Hi", max_tokens=2, n=1, extra_body={"best_of": 2})
    out = client.completions.create(
        model="tiny",
        prompt="Hi",
        max_tokens=2,
        n=2,
        extra_body={
            "best_of": 2,
            "ignore_eos": True,
            "min_tokens": 2,
            "top_k": 5,
            "min_p": 0.01,
            "repetition_penalty": 1.1,
        },
    )
    assert len(out.choices) == 2 and out.usage.completion_tokens == 4


def test_chat_logprobs(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for item in content:
        assert item.logprob <= 0.0 and len(item.top_logprobs) == 2
        # greedy: the chosen token is the most likely one
        assert item.logprob == pytest.approx(max(t.logprob for t in item.top_logprobs))


def test_models_list(client: openai.OpenAI) -> None:
    ids = {m.id for m in client.models.list()}
    assert {"tiny", "@cf/test/tiny"} <= ids


def test_timing_header_and_session_affinity(shared_node) -> None:
    r = httpx.post(
        shared_node.url + "/v1/completions",
        json={"model": "tiny", "prompt": "Hello", "max_tokens": 2},
        headers={"x-session-affinity": "sess-42"},
    )
    assert r.status_code == 200
    assert r.headers["x-session-affinity"] == "sess-42"
    timing = dict(part.split("=") for part in r.headers["x-edgeinfer-timing"].split(";"))
    assert set(timing) == {"queue", "prefill", "decode"}
    assert all(float(v) >= 0 for v in timing.values())

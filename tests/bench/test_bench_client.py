"""The load generator end to end against a real OpenAI-shaped streaming server on loopback."""

from __future__ import annotations

import asyncio
import itertools
import math
import statistics

import pytest
from bench_sse_server import StreamServerSettings

from edgeinfer.bench.datasets import Session, multi_turn_dataset, random_dataset
from edgeinfer.bench.runner import AFFINITY_HEADER, BenchConfig, BenchResult, arrival_offsets, run_benchmark


def _run(config: BenchConfig, sessions: list[Session]) -> BenchResult:
    return asyncio.run(run_benchmark(config, sessions))


def test_completions_run_counts_tokens_and_honours_concurrency(
    stream_server: str, stream_settings: StreamServerSettings
) -> None:
    sessions = random_dataset(6, (4, 9), (5, 8), seed=0)
    result = _run(BenchConfig(base_url=stream_server, model="m", max_concurrency=2), sessions)
    s = result.summary
    assert (s.completed, s.failed) == (6, 0)
    assert s.total_output_tokens == s.requested_output_tokens == sum(x.turns[0].max_tokens for x in sessions)
    assert s.usage_reported_fraction == 1.0
    assert stream_settings.max_in_flight == 2  # capped, and the cap was reached
    body = stream_settings.received[0]["body"]
    assert body["ignore_eos"] is True and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    sent = sorted(r["body"]["prompt"] for r in stream_settings.received)
    assert sent == sorted(x.turns[0].text for x in sessions)
    for r in result.records:
        # The server sleeps ttft_s before the first token and itl_s between tokens: hard lower bounds
        # from the request's start (not from the measured ttft: a client that reads the first chunk late,
        # on a loaded machine, then finds the next ones already buffered).
        assert r.ttft >= stream_settings.ttft_s
        assert r.e2e >= stream_settings.ttft_s + (r.output_tokens - 1) * stream_settings.itl_s
        assert r.text == "".join(f" w{i}" for i in range(r.output_tokens))
        assert r.finish_reason == "length"
    assert s.duration_s >= max(r.e2e for r in result.records)


def test_chat_role_chunk_is_not_a_token_and_no_usage_falls_back_to_counting(
    stream_server: str, stream_settings: StreamServerSettings
) -> None:
    stream_settings.send_usage = False
    sessions = random_dataset(3, (6, 6), (4, 4), seed=1)
    config = BenchConfig(base_url=stream_server, model="m", endpoint="/v1/chat/completions")
    result = _run(config, sessions)
    assert result.summary.completed == 3
    for r in result.records:
        assert not r.usage_reported
        assert (r.output_tokens, len(r.chunk_times), r.prompt_tokens) == (4, 4, 6)
    assert stream_settings.received[0]["body"]["messages"][0]["role"] == "user"


def test_errors_are_recorded_and_the_run_continues(stream_server: str) -> None:
    sessions = random_dataset(4, (3, 3), (5, 5), seed=2)
    bad = [
        type(s)(s.session_id, (type(s.turns[0])(text, 5, 1),))
        for s, text in zip(sessions[:2], ["please FAIL now", "MIDERR here"], strict=True)
    ]
    result = _run(BenchConfig(base_url=stream_server, model="m"), bad + sessions[2:])
    s = result.summary
    assert (s.completed, s.failed) == (2, 2)
    assert any(e.startswith("HTTP 500") for e in s.errors)
    assert any("boom" in e for e in s.errors)


def test_unreachable_server_fails_every_request_without_raising() -> None:
    result = _run(BenchConfig(base_url="http://127.0.0.1:9", model="m"), random_dataset(3, (2, 2), (2, 2), 0))
    assert (result.summary.completed, result.summary.failed) == (0, 3)
    assert math.isnan(result.summary.ttft_ms.mean)


def test_multi_turn_sends_history_in_order_with_affinity(
    stream_server: str, stream_settings: StreamServerSettings
) -> None:
    sessions = multi_turn_dataset(6, turns_per_session=3, input_len=(2, 3), output_len=(2, 2), seed=4)
    config = BenchConfig(base_url=stream_server, model="m", endpoint="/v1/chat/completions")
    result = _run(config, sessions)
    assert result.summary.completed == 6
    for session in sessions:
        mine = [(i, r) for i, r in enumerate(stream_settings.received)
                if r["headers"].get(AFFINITY_HEADER) == session.session_id]  # fmt: skip
        assert len(mine) == 3
        for k, (index, req) in enumerate(mine):
            messages = req["body"]["messages"]
            assert [m["role"] for m in messages] == ["user", "assistant"] * k + ["user"]
            assert [m["content"] for m in messages[::2]] == [t.text for t in session.turns[: k + 1]]
            assert all(m["content"] == " w0 w1" for m in messages[1::2])  # the answers actually streamed
            if k:  # turn k is sent only after turn k-1's stream ended
                assert req["time"] >= stream_settings.finished[mine[k - 1][0]]
            assert index in stream_settings.finished


def test_multi_turn_on_completions_grows_one_text_prompt(
    stream_server: str, stream_settings: StreamServerSettings
) -> None:
    sessions = multi_turn_dataset(2, turns_per_session=2, input_len=(2, 2), output_len=(3, 3), seed=5)
    _run(BenchConfig(base_url=stream_server, model="m"), sessions)
    first, second = (r["body"]["prompt"] for r in stream_settings.received)
    assert second == "\n".join([first, " w0 w1 w2", sessions[0].turns[1].text])


def test_failed_turn_skips_the_rest_of_its_session() -> None:
    sessions = multi_turn_dataset(3, turns_per_session=3, input_len=(2, 2), output_len=(2, 2), seed=0)
    result = _run(BenchConfig(base_url="http://127.0.0.1:9", model="m"), sessions)
    assert result.summary.failed == 3
    assert sum(r.error.startswith("skipped") for r in result.records) == 2


def test_arrival_offsets_are_poisson_with_the_requested_rate() -> None:
    offsets = arrival_offsets(4001, rate=8.0, burstiness=1.0, seed=0)
    gaps = [b - a for a, b in itertools.pairwise(offsets)]
    assert offsets[0] == 0.0
    assert statistics.fmean(gaps) == pytest.approx(1 / 8, rel=0.05)
    assert statistics.stdev(gaps) / statistics.fmean(gaps) == pytest.approx(1.0, rel=0.1)  # exponential: CV 1
    bursty = arrival_offsets(4001, rate=8.0, burstiness=0.25, seed=0)
    bursty_gaps = [b - a for a, b in itertools.pairwise(bursty)]
    assert statistics.stdev(bursty_gaps) / statistics.fmean(bursty_gaps) == pytest.approx(2.0, rel=0.15)
    assert arrival_offsets(3, math.inf, 1.0, 0) == [0.0, 0.0, 0.0]
    assert offsets == arrival_offsets(4001, 8.0, 1.0, 0)


def test_paced_run_lasts_at_least_until_the_last_arrival(stream_server: str) -> None:
    config = BenchConfig(base_url=stream_server, model="m", request_rate=20.0, seed=3)
    result = _run(config, random_dataset(5, (2, 2), (2, 2), seed=0))
    assert result.summary.duration_s >= arrival_offsets(5, 20.0, 1.0, 3)[-1]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"endpoint": "/v1/embeddings"}, "endpoint"), ({"request_rate": 0.0}, "request_rate"),
     ({"max_concurrency": 0}, "max_concurrency"), ({"burstiness": -1.0}, "burstiness")],
)  # fmt: skip
def test_config_rejects_bad_values(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        BenchConfig(base_url="http://x", model="m", **kwargs)

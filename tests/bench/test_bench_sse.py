"""The SSE parser against the framing variants real servers emit, fed in arbitrary pieces."""

from __future__ import annotations

import pytest

from edgeinfer.bench.sse import SSEEvent, SSEParser

STREAM = (
    ": keep-alive comment\n"
    'data: {"a": 1}\n\n'
    "event: ping\ndata: x\n\n"
    "data: line one\ndata:line two\n\n"
    "id: 7\nretry: 100\ndata: [DONE]\n\n"
)
EXPECTED = [
    SSEEvent('{"a": 1}'),
    SSEEvent("x", event="ping"),
    SSEEvent("line one\nline two"),
    SSEEvent("[DONE]"),
]


def _feed_in_pieces(text: str, size: int) -> list[SSEEvent]:
    parser = SSEParser()
    events: list[SSEEvent] = []
    for i in range(0, len(text), size):
        events += parser.feed(text[i : i + size])
    return events + parser.close()


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_events_survive_any_split(size: int) -> None:
    assert _feed_in_pieces(STREAM, size) == EXPECTED


@pytest.mark.parametrize("newline", ["\r\n", "\r"])
@pytest.mark.parametrize("size", [1, 5, 1000])
def test_crlf_and_cr_line_ends(newline: str, size: int) -> None:
    assert _feed_in_pieces(STREAM.replace("\n", newline), size) == EXPECTED


def test_final_event_without_blank_line_is_dispatched_on_close() -> None:
    parser = SSEParser()
    assert parser.feed('data: {"last": true}') == []
    assert parser.close() == [SSEEvent('{"last": true}')]


def test_blank_lines_without_data_dispatch_nothing() -> None:
    parser = SSEParser()
    assert parser.feed("\n\nevent: lonely\n\n\n") == []
    assert parser.feed("data: after\n\n") == [SSEEvent("after")]  # the dropped event type does not leak


def test_only_one_space_after_colon_is_stripped() -> None:
    assert SSEParser().feed("data:  two spaces\n\n") == [SSEEvent(" two spaces")]

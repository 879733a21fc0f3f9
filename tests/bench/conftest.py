"""Fixtures for the bench tests: a real streaming server on loopback."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from bench_sse_server import StreamServerSettings, serve


@pytest.fixture
def stream_settings() -> StreamServerSettings:
    return StreamServerSettings()


@pytest.fixture
def stream_server(stream_settings: StreamServerSettings) -> Iterator[str]:
    """Base URL of a running OpenAI-shaped SSE server (configure it through `stream_settings`)."""
    with serve(stream_settings) as url:
        yield url

"""The router's HTTP server: uvicorn with uvloop and httptools where installed (the `fast` extra), and
parser errors in OpenAI's shape (api/http/parser_errors.py)."""

from __future__ import annotations

import importlib.util
from typing import Any

import uvicorn

from edgeinfer.api.http.parser_errors import http_protocol

GRACEFUL_SHUTDOWN_S = 10


def server_implementation() -> tuple[str, str]:
    """uvloop and httptools where installed: the router is all event loop and HTTP parsing; otherwise
    asyncio's loop and h11, which behave the same, only slower."""
    loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    http = "httptools" if importlib.util.find_spec("httptools") else "h11"
    return loop, http


def uvicorn_config(app: Any, host: str, port: int, **options: Any) -> uvicorn.Config:
    loop, http = server_implementation()
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        loop=loop,
        http=http_protocol(http),
        access_log=False,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        **options,
    )

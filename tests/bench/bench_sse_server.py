"""A small real OpenAI-shaped streaming server for the load-generator tests, run by uvicorn on loopback.

It streams one word per token with fixed delays, so the client's timings have known lower bounds, and it
records every request so tests can check what the client sent. Prompts containing "FAIL" get HTTP 500; prompts
containing "MIDERR" get an error event mid-stream.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse


@dataclass
class StreamServerSettings:
    ttft_s: float = 0.02
    itl_s: float = 0.005
    send_usage: bool = True
    chat_role_chunk: bool = True  # chat streams open with a role-only delta, as OpenAI's do
    received: list[dict[str, Any]] = field(default_factory=list)
    finished: dict[int, float] = field(default_factory=dict)  # index in `received` -> time its stream ended
    in_flight: int = 0
    max_in_flight: int = 0


def _prompt_text(body: dict[str, Any]) -> str:
    if "messages" in body:
        return "\n".join(m["content"] for m in body["messages"])
    return str(body.get("prompt", ""))


def _chunk(chat: bool, text: str | None, finish: str | None = None) -> dict[str, Any]:
    if chat:
        delta = {} if text is None else {"content": text}
        return {
            "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        }
    return {
        "object": "text_completion",
        "choices": [{"index": 0, "text": text or "", "finish_reason": finish}],
    }


async def _stream(
    body: dict[str, Any], chat: bool, settings: StreamServerSettings, index: int
) -> AsyncIterator[str]:
    settings.in_flight += 1
    settings.max_in_flight = max(settings.max_in_flight, settings.in_flight)
    try:
        async for piece in _tokens(body, chat, settings):
            yield piece
    finally:
        settings.in_flight -= 1
        settings.finished[index] = time.perf_counter()


async def _tokens(body: dict[str, Any], chat: bool, settings: StreamServerSettings) -> AsyncIterator[str]:
    n = int(body.get("max_tokens", 16))
    prompt = _prompt_text(body)
    if chat and settings.chat_role_chunk:
        yield "data: " + json.dumps({"choices": [{"index": 0, "delta": {"role": "assistant"}}]}) + "\n\n"
    await asyncio.sleep(settings.ttft_s)
    for i in range(n):
        if i:
            await asyncio.sleep(settings.itl_s)
        if "MIDERR" in prompt and i == 2:
            yield "data: " + json.dumps({"error": {"message": "boom", "code": 500}}) + "\n\n"
            return
        yield "data: " + json.dumps(_chunk(chat, f" w{i}", "length" if i == n - 1 else None)) + "\n\n"
    if settings.send_usage and (body.get("stream_options") or {}).get("include_usage"):
        usage = {"prompt_tokens": len(prompt.split()), "completion_tokens": n, "total_tokens": 0}
        yield "data: " + json.dumps({"choices": [], "usage": usage}) + "\n\n"
    yield "data: [DONE]\n\n"


def make_app(settings: StreamServerSettings) -> FastAPI:
    app = FastAPI()

    async def handle(request: Request, chat: bool) -> Any:
        body = await request.json()
        settings.received.append({"path": request.url.path, "headers": dict(request.headers), "body": body,
                                  "time": time.perf_counter()})  # fmt: skip
        if "FAIL" in _prompt_text(body):
            return JSONResponse({"error": {"message": "asked to fail"}}, status_code=500)
        index = len(settings.received) - 1
        return StreamingResponse(_stream(body, chat, settings, index), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        return await handle(request, chat=True)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "stub-model", "object": "model"}]}

    return app


@contextmanager
def serve(settings: StreamServerSettings) -> Iterator[str]:
    """Run the app on 127.0.0.1 on a free port in a background thread; yield its base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(make_app(settings), log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()

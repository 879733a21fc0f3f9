"""A node stand-in for router benchmarks: streams a fixed completion at a fixed rate, and reports an idle
NodeStatus, so that what is measured is the proxy, not a model. `python bench/router_stub.py PORT`."""

from __future__ import annotations

import asyncio
import json
import sys
import time

import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response, StreamingResponse

CHUNKS = 16
INTERVAL_S = 0.01  # 100 chunks/s after the first, which is sent at once
app = FastAPI()


def _chunk(i: int) -> bytes:
    body = {"id": "cmpl-stub", "object": "text_completion", "choices": [{"index": 0, "text": f" t{i}"}]}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


async def _stream():
    for i in range(CHUNKS):
        if i:
            await asyncio.sleep(INTERVAL_S)
        yield _chunk(i)
    yield b"data: [DONE]\n\n"


@app.post("/v1/completions")
@app.post("/v1/chat/completions")
async def completions() -> Response:
    return StreamingResponse(_stream(), media_type="text/event-stream")


@app.get("/node/status")
async def status() -> Response:
    body = {
        "node_id": "stub",
        "location": "FRA",
        "models_available": ["stub"],
        "models_warm": ["stub"],
        "capacity": 1024,
        "ts": time.time(),
    }
    return JSONResponse(body)


@app.get("/health")
@app.get("/ready")
@app.get("/health_generate")
async def health() -> dict[str, str]:
    return {"status": "ok"}


@app.get("/v1/models")
async def models() -> dict[str, object]:
    return {"object": "list", "data": [{"id": "stub", "object": "model"}]}


@app.get("/get_model_info")
async def model_info() -> dict[str, object]:
    return {"model_path": "stub", "is_generation": True}


@app.get("/get_server_info")
async def server_info() -> dict[str, object]:
    return {"model_path": "stub"}


if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning", access_log=False)

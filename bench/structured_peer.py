"""llama.cpp's llama-server as the peer of bench/structured.py: TPOT with the same JSON schema (its
`response_format`, compiled to a GBNF grammar) against unconstrained, on the same Gemma 3 270M GGUF.

Each request streams; its TPOT is (last token chunk - first) / (chunks - 1). Runs interleave free / JSON.
"""

from __future__ import annotations

import asyncio
import socket
import statistics
import time
from pathlib import Path
from typing import Any

import httpx
from peers import llama_server


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _one(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> tuple[float, int] | None:
    stamps = []
    async with client.stream("POST", url, json=body) as reply:
        async for line in reply.aiter_lines():
            if line.startswith("data: ") and '"content"' in line and '"content":""' not in line:
                stamps.append(time.perf_counter())
    if len(stamps) < 2:
        return None
    return (stamps[-1] - stamps[0]) / (len(stamps) - 1) * 1000, len(stamps)


async def _run(url: str, bodies: list[dict[str, Any]]) -> float:
    async with httpx.AsyncClient(timeout=600) as client:
        results = await asyncio.gather(*(_one(client, url, b) for b in bodies))
    return statistics.mean(r[0] for r in results if r is not None)


def peer_rows(
    gguf: Path,
    questions: list[str],
    schema: dict[str, Any],
    concurrency: list[int],
    max_tokens: int,
    repeats: int,
) -> list[tuple[int, list[float], list[float]]]:
    """(concurrency, free TPOTs, JSON TPOTs) per level, from one llama-server with enough slots."""
    port = _port()
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    rows = []
    with llama_server(gguf, port, n_parallel=max(concurrency), ctx=1024, threads=1):
        for c in concurrency:
            free, constrained = [], []
            for _ in range(repeats):
                for target, extra in ((free, {"ignore_eos": True}), (constrained, {"response_format": fmt})):
                    bodies = [
                        {
                            "model": "peer",
                            "messages": [{"role": "user", "content": questions[i % len(questions)]}],
                            "max_tokens": max_tokens,
                            "temperature": 0,
                            "stream": True,
                            **extra,
                        }
                        for i in range(c)
                    ]
                    target.append(asyncio.run(_run(url, bodies)))
            rows.append((c, free, constrained))
    return rows

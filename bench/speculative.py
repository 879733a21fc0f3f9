"""Speculative decoding, edgeinfer against llama-server in one run: one stream's decode speed with and without
n-gram drafting on a copy-heavy prompt (a passage given twice, a third copy begun) and on open generation
(a chat question), and 32 concurrent streams' throughput with ours on and off.

Gemma 3 270M at bf16 on both sides: ours `edgeinfer serve` (bf16 from the default Q4_K_M GGUF), without
and with `--speculative-method ngram` (its default 8-token drafts, and 16) and `self` (its own int4 form
drafting, 8 and 4 tokens); no separate draft model of Gemma 3's vocabulary is at hand offline (270M is the
smallest Gemma 3), so there is no `draft` row; llama-server on the BF16
GGUF llama-quantize makes of the same file, without speculation and with each of its n-gram drafters
(`--spec-type ngram-simple`, `ngram-mod`, `ngram-map-k`, their default sizes). Each server at the
machine's default thread count, one at a time; greedy, `ignore_eos`. Decode speed: (completion tokens - 1)
/ (last chunk - first chunk) of a stream, the best of `--repeats` (tokens from the usage the stream ends
with: a step that accepts drafts sends several at once).

    .venv/bin/python bench/speculative.py [--tokens 256] [--repeats 2] [--write-docs]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "src"), str(REPO / "bench")]

import peers  # noqa: E402
from docs_table import replace_section  # noqa: E402
from serve_vs_llamacpp import our_server  # noqa: E402

from edgeinfer.bench.process import ServerProcess, start_server  # noqa: E402
from edgeinfer.engine.model.loader.default_model import resolve_default_model  # noqa: E402

DOCS = REPO / "docs" / "benchmarks.md"
PORT = 8573
MODEL = "gemma-3-270m"
# ours with the default draft length (8) and a longer one
OURS = {
    "edgeinfer": [],
    "edgeinfer, ngram (k=8)": ["--speculative-method", "ngram"],
    "edgeinfer, ngram (k=16)": ["--speculative-method", "ngram", "--num-speculative-tokens", "16"],
    # self-speculation: the model's own int4 form drafts, its head over the 65,536 most frequent tokens
    "edgeinfer, self (k=8)": ["--speculative-method", "self"],
    "edgeinfer, self (k=4)": ["--speculative-method", "self", "--num-speculative-tokens", "4"],
}
LLAMA_SPEC_TYPES = ("ngram-simple", "ngram-mod", "ngram-map-k")
PASSAGE = (
    "The lighthouse stood on a rock a mile from the shore. Every evening the keeper climbed the hundred "
    "and twelve steps to the lamp room, trimmed the wick, wound the clockwork that turned the lens, and "
    "wrote the weather in his log: the wind, the sea, the ships that passed and the hour the light went "
    "on. In winter the spray froze on the glass and he scraped it clear twice a night; in summer he kept "
    "the windows open and listened to the gulls. Supplies came by boat on the first day of each month, "
    "weather permitting, with letters, oil, flour and the newspaper, which he read slowly, a page a day, "
    "to make it last."
)
COPY_PROMPT = f"Copy the text exactly.\n\n{PASSAGE}\n\n{PASSAGE}\n\n{PASSAGE[:80]}"
OPEN_QUESTION = "Explain in a few paragraphs how a refrigerator keeps food cold."
CONCURRENT_QUESTIONS = [
    f"Write a short paragraph about {topic}."
    for topic in (
        "rivers", "bridges", "owls", "copper", "tides", "maps", "clocks", "bread", "glass", "kites",
        "deserts", "volcanoes", "bees", "salt", "trains", "ink", "moss", "lanterns", "wolves", "silk",
        "coral", "comets", "harbors", "paper", "wind", "caves", "apples", "storms", "bells", "roads",
        "islands", "mirrors",
    )
]  # fmt: skip


def stream_rate(url: str, body: dict) -> tuple[float, int]:
    """(decode tokens per second, completion tokens) of one streamed request."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    arrivals: list[float] = []
    tokens = 0
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    with httpx.stream("POST", url + path, json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            choice = (chunk.get("choices") or [{}])[0]
            if choice.get("text") or (choice.get("delta") or {}).get("content"):
                arrivals.append(time.perf_counter())
    return (tokens - 1) / (arrivals[-1] - arrivals[0]), tokens


def workloads(tokens: int) -> dict[str, dict]:
    common = {"model": MODEL, "max_tokens": tokens, "temperature": 0.0, "ignore_eos": True}
    return {
        "copy": {**common, "prompt": COPY_PROMPT},
        "open": {**common, "messages": [{"role": "user", "content": OPEN_QUESTION}]},
    }


def single_stream(url: str, tokens: int, repeats: int) -> dict[str, float]:
    stream_rate(url, {"model": MODEL, "prompt": "Hello", "max_tokens": 4})  # first-use costs out of the way
    out = {}
    for name, body in workloads(tokens).items():
        out[name] = max(stream_rate(url, body)[0] for _ in range(repeats))
    return out


async def _one(client: httpx.AsyncClient, url: str, question: str, tokens: int) -> int:
    body = {"model": MODEL, "messages": [{"role": "user", "content": question}], "max_tokens": tokens,
            "temperature": 0.0, "ignore_eos": True}  # fmt: skip
    r = await client.post(url + "/v1/chat/completions", json=body, timeout=900)
    r.raise_for_status()
    return int(r.json()["usage"]["completion_tokens"])


async def _concurrent(url: str, tokens: int) -> float:
    async with httpx.AsyncClient() as client:
        started = time.perf_counter()
        done = await asyncio.gather(*(_one(client, url, q, tokens) for q in CONCURRENT_QUESTIONS))
        return sum(done) / (time.perf_counter() - started)


def concurrent_rate(url: str, tokens: int, repeats: int) -> float:
    """Output tokens per second of 32 chat requests sent at once, the best of `repeats` after a short
    round (a server's first batch of 32 pays first-use costs)."""
    asyncio.run(_concurrent(url, 4))
    return max(asyncio.run(_concurrent(url, tokens)) for _ in range(repeats))


@contextmanager
def llama(gguf: Path, spec_type: str | None) -> Iterator[ServerProcess]:
    threads = os.cpu_count() or 1
    argv = peers.llama_server_argv(gguf, PORT, n_parallel=1, ctx=4096, threads=threads)
    if spec_type is not None:
        argv += ["--spec-type", spec_type]
    log = peers.PEERS_DIR / "logs" / f"llama-server-spec-{spec_type or 'none'}.log"
    server = start_server(argv, f"http://127.0.0.1:{PORT}", log, health_path="/health")
    try:
        yield server
    finally:
        server.stop()


def measure(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    threads = os.cpu_count() or 1
    rows: dict[str, dict[str, float]] = {}
    for name, extra in OURS.items():
        if args.only is not None and name != "edgeinfer" and name not in args.only:
            continue
        with our_server(MODEL, PORT, extra, threads) as server:
            rows[name] = single_stream(server.base_url, args.tokens, args.repeats)
            rows[name]["concurrent"] = concurrent_rate(server.base_url, args.concurrent_tokens, args.repeats)
        print(name, rows[name], f"load {os.getloadavg()[0]:.1f}", flush=True)
    if args.ours_only:
        return rows
    gguf = peers.peer_gguf("bf16", resolve_default_model())
    for spec_type in (None, *LLAMA_SPEC_TYPES):
        name = f"llama.cpp, {spec_type}" if spec_type else "llama.cpp"
        with llama(gguf, spec_type) as server:
            rows[name] = single_stream(server.base_url, args.tokens, args.repeats)
        print(name, rows[name], f"load {os.getloadavg()[0]:.1f}", flush=True)
    return rows


def table(rows: dict[str, dict[str, float]], args: argparse.Namespace) -> str:
    flags = " ".join(
        sorted(peers.cpu_flags() & {"avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile"})
    )
    base = rows["edgeinfer"]
    lines = [
        f"### Speculative decoding: edgeinfer vs llama.cpp, bf16, {peers.cpu_family()} CPU",
        "",
        f"Machine: {peers.cpuinfo_field('model name')}, {os.cpu_count()} CPUs ({flags}); each server at "
        f"its default thread count, one at a time; 1-min load average {os.getloadavg()[0]:.1f} after (the "
        "machine is shared with other work).",
        "Model: Gemma 3 270M. Ours: `edgeinfer serve` (bf16 from the default GGUF), `--speculative-method "
        "ngram` (n-gram 2..4, `--num-speculative-tokens` k) or `self` (the model's int4 form drafts) where "
        "named; llama.cpp: llama-server "
        f"(llama-cpp-python {peers.LLAMA_CPP_PYTHON_VERSION}) on the BF16 GGUF of the same file, "
        "`--spec-type` as named at its default sizes. One stream, greedy, "
        f"{args.tokens} tokens, best of {args.repeats}: "
        "copy = a ~150-word passage given twice and a third copy begun (`/v1/completions`); open = a chat "
        f"question. 32 concurrent: 32 chat requests of {args.concurrent_tokens} tokens sent at once, best "
        f"of {args.repeats} (ours only).",
        f"Command: `.venv/bin/python bench/speculative.py --tokens {args.tokens} --write-docs`",
        "",
        "| server | copy (tok/s) | open (tok/s) | 32 concurrent (tok/s) | copy vs our plain "
        "| open vs our plain |",
        "|---|---|---|---|---|---|",
    ]
    for name, row in rows.items():
        conc = f"{row['concurrent']:.1f}" if "concurrent" in row else ""
        lines.append(
            f"| {name} | {row['copy']:.1f} | {row['open']:.1f} | {conc} | {row['copy'] / base['copy']:.2f}x "
            f"| {row['open'] / base['open']:.2f}x |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--concurrent-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--write-docs", action="store_true")
    ap.add_argument("--ours-only", action="store_true", help="skip llama-server (not for --write-docs)")
    ap.add_argument("--only", nargs="*", default=None, help="of ours, these rows only (and the plain one)")
    args = ap.parse_args()
    if args.write_docs and (args.ours_only or args.only is not None):
        ap.error("--write-docs needs every row")
    peers.build()
    rows = measure(args)
    text = table(rows, args)
    print(text)
    if args.write_docs:
        replace_section(DOCS, f"speculative-{peers.cpu_family()}", text)


if __name__ == "__main__":
    main()

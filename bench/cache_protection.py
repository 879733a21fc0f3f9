"""Shared-cache protection on our node with the default model (Gemma 3 270M), one run:

    python bench/cache_protection.py [--quick]

1. `audit-cache` with caching on: cross-tenant AUC (target <= 0.6) and the same-tenant control (>= 0.9).
2. TTFT of a hit at a ~2,000-token prefix against a miss (interleaved; target >= 10x).
3. A ~1,000-token public system prompt shared by 16 tenants: cached KV blocks and TTFT p50, against full
   per-tenant isolation (the same server without --public-prefixes).
4. Flood: a victim's TTFT p50 while another tenant floods cache and queue, against its solo value, with
   tenant shares and fair scheduling on, and off (--no-tenant-shares).
Writes its block of docs/benchmarks.md (cache-protection).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "src"), str(REPO / "bench")]

from docs_table import replace_section  # noqa: E402
from startup import cpu_flags  # noqa: E402

from edgeinfer.api.keys import hash_key  # noqa: E402
from edgeinfer.bench.audit_cache import audit, fresh_prompt, ttft  # noqa: E402

MODEL = "gemma-3-270m"
TENANTS = [f"t{i}" for i in range(16)]
WORDS_PER_1K_TOKENS = 900
# timing hygiene's bucket: above a ~450-token miss here, so that hits and misses both end on its first end
TTFT_BUCKET_MS = 1000  # our random words are ~1.1 Gemma tokens each


def key(name: str) -> str:
    return f"ei-bench-{name}"


class Node:
    def __init__(self, workdir: Path, *extra: str) -> None:
        self.port = 18000 + random.randrange(2000)
        tenants = workdir / "tenants.json"
        tenants.write_text(
            json.dumps({"tenants": [{"name": n, "key_sha256": hash_key(key(n))} for n in TENANTS]})
        )
        self.cmd = [
            sys.executable, "-m", "edgeinfer.node", "--port", str(self.port), "--model", MODEL, "--preload",
            "--tenants", str(tenants), "--usage-db", str(workdir / f"u{self.port}.sqlite"), "--no-access-log",
            "--threads", "2", *extra,
        ]  # fmt: skip
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(workdir / f"node{self.port}.log", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT)

    def __enter__(self) -> Node:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"node exited: {' '.join(self.cmd)}")
            try:
                if httpx.get(self.url + "/ready", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError("node did not become ready")

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        self.proc.wait(30)
        self.log.close()

    def cached_blocks(self) -> int:
        text = httpx.get(self.url + "/metrics").text
        lines = [ln for ln in text.splitlines() if ln.startswith("edgeinfer:tenant_cached_blocks{")]
        return int(sum(float(ln.rsplit(" ", 1)[1]) for ln in lines))

    def kv_usage(self) -> float:
        text = httpx.get(self.url + "/metrics").text
        line = next(ln for ln in text.splitlines() if ln.startswith("edgeinfer:kv_cache_usage_perc{"))
        return float(line.rsplit(" ", 1)[1])


async def one(url: str, tenant: str, prompt: str) -> float:
    async with httpx.AsyncClient(base_url=url, timeout=600) as c:
        return await ttft(c, MODEL, key(tenant), prompt)


class Lines(list[str]):
    """Result rows, each also printed as soon as it is measured (a long run shows progress)."""

    def append(self, line: str) -> None:
        print(line, flush=True)
        super().append(line)


def p50(xs: list[float]) -> float:
    return statistics.median(xs) * 1e3


async def speedup(url: str, rng: random.Random, reps: int) -> tuple[float, float]:
    hits, misses = [], []
    for _ in range(reps):
        prompt = fresh_prompt(rng, 2 * WORDS_PER_1K_TOKENS)
        misses.append(await one(url, "t0", prompt))
        hits.append(await one(url, "t0", prompt + " and one more question"))
    return p50(misses), p50(hits)


async def shared_system(url: str, system: str, rng: random.Random) -> list[float]:
    out = []
    for tenant in TENANTS:
        out.append(await one(url, tenant, system + " " + fresh_prompt(rng, 20)))
    return out


@dataclass
class Flood:
    victim_ttft_s: list[float]
    flooder_ttft_s: list[float]  # the flooding tenant's requests that finished while the victim measured
    seconds: float


async def flood(
    url: str, rng: random.Random, victim_prompts: list[str], flooders: int, seconds: float
) -> Flood:
    """The victim's TTFTs (cycling through its own prompts, one request at a time, for `seconds`) while
    `flooders` concurrent streams of fresh long prompts from another tenant keep the queue and the cache
    full; and the flooder's requests that finished meanwhile (what protecting the victim costs it)."""
    stop = asyncio.Event()
    measuring = asyncio.Event()
    flooder_ttft: list[float] = []

    async def flooder() -> None:
        while not stop.is_set():
            took = await one(url, "t1", fresh_prompt(rng, 700))
            if measuring.is_set() and not stop.is_set():
                flooder_ttft.append(took)

    tasks = [asyncio.create_task(flooder()) for _ in range(flooders)]
    await asyncio.sleep(3.0)  # the queue fills
    measuring.set()
    start = time.monotonic()
    out = []
    for prompt in itertools.cycle(victim_prompts):
        out.append(await one(url, "t0", prompt))
        if time.monotonic() - start >= seconds:
            break
    elapsed = time.monotonic() - start
    stop.set()
    await asyncio.gather(*tasks)
    return Flood(out, flooder_ttft, elapsed)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer samples (a smoke run)")
    args = parser.parse_args()
    n_audit, reps, flood_s = (6, 2, 8.0) if args.quick else (16, 3, 30.0)
    rng = random.Random(0)
    load_before = os.getloadavg()[0]
    lines = Lines()
    system = "You are a careful assistant. " + fresh_prompt(random.Random(7), WORDS_PER_1K_TOKENS)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        with Node(work) as node:
            res = asyncio.run(audit(node.url, key("t0"), key("t1"), MODEL, n_audit, 400, 1))
            lines.append(
                f"| audit-cache, caching on ({n_audit} prompts, ~450 tokens) | cross-tenant AUC "
                f"{res.auc_other_vs_unseen:.2f} (KS p {res.ks_other_vs_unseen[1]:.2g}); "
                "same-tenant control AUC "
                f"{res.auc_same_vs_unseen:.2f} (KS p {res.ks_same_vs_unseen[1]:.2g}) | TTFT p50 ms: same "
                f"{p50(res.same_tenant_ttft_s):.0f}, other {p50(res.other_tenant_ttft_s):.0f}, "
                f"unseen {p50(res.unseen_ttft_s):.0f} |"
            )
            miss, hit = asyncio.run(speedup(node.url, rng, reps))
            lines.append(
                f"| hit at a ~2,000-token prefix ({reps} pairs) | TTFT p50 miss {miss:.0f} ms, "
                f"hit {hit:.0f} ms: "
                f"**{miss / hit:.1f}x** | |"
            )
            iso = asyncio.run(shared_system(node.url, system, rng))
            iso_blocks = node.cached_blocks()
        with Node(work, "--ttft-bucket-ms", str(TTFT_BUCKET_MS)) as node:
            bucketed = asyncio.run(audit(node.url, key("t0"), key("t1"), MODEL, n_audit, 400, 1))
        lines.append(
            f"| the same audit with --ttft-bucket-ms {TTFT_BUCKET_MS} | same-tenant AUC "
            f"{bucketed.auc_same_vs_unseen:.2f} (KS p {bucketed.ks_same_vs_unseen[1]:.2g}), cross-tenant "
            f"{bucketed.auc_other_vs_unseen:.2f} | the cost, TTFT p50: hits {p50(res.same_tenant_ttft_s):.0f}"
            f" -> {p50(bucketed.same_tenant_ttft_s):.0f} ms, misses {p50(res.unseen_ttft_s):.0f} -> "
            f"{p50(bucketed.unseen_ttft_s):.0f} ms |"
        )
        public_file = work / "public.json"
        public_file.write_text(json.dumps({MODEL: {"texts": [system]}}))
        with Node(work, "--public-prefixes", str(public_file)) as node:
            pinned = node.kv_usage()
            pub = asyncio.run(shared_system(node.url, system, rng))
            pub_blocks = node.cached_blocks()
        lines.append(
            f"| ~1,000-token system prompt, 16 tenants | isolation: {iso_blocks} cached blocks, TTFT p50 "
            f"{p50(iso):.0f} ms; public prefix: {pub_blocks} cached blocks + the pinned prefix "
            f"({pinned:.1%} of the pool), TTFT p50 {p50(pub):.0f} ms | |"
        )
        victim = [fresh_prompt(rng, 30) for _ in range(3)]
        for label, extra in (
            ("shares, fair scheduling and shared step time on", ()),
            ("without the shared step time (--shared-step-ms 0)", ("--shared-step-ms", "0")),
            (
                "all off (--no-tenant-shares --shared-step-ms 0)",
                ("--no-tenant-shares", "--shared-step-ms", "0"),
            ),
        ):
            with Node(work, "--kv-cache-memory", "48MiB", *extra) as node:
                solo = [asyncio.run(one(node.url, "t0", p)) for p in victim * 2]
                flooded = asyncio.run(flood(node.url, rng, victim, 6, flood_s))
            rate = len(flooded.flooder_ttft_s) / flooded.seconds * 60
            lines.append(
                f"| flood, {label} | victim TTFT p50 solo {p50(solo):.0f} ms, "
                f"under flood {p50(flooded.victim_ttft_s):.0f} ms: "
                f"**{p50(flooded.victim_ttft_s) / p50(solo):.2f}x** | flooder (6 concurrent ~800-token "
                f"streams): {rate:.0f} requests/min, TTFT p50 "
                f"{p50(flooded.flooder_ttft_s) if flooded.flooder_ttft_s else float('nan'):.0f} ms |"
            )
    load_after = os.getloadavg()[0]
    body = "\n".join(
        [
            "### Shared-cache protection (bench/cache_protection.py)",
            "",
            f"`python bench/cache_protection.py{' --quick' if args.quick else ''}` on "
            f"{platform.processor() or platform.machine()} ({os.cpu_count()} cores; {cpu_flags()}); "
            "Gemma 3 270M (default GGUF), node `--threads 2`; 1-min load"
            f" average {load_before:.1f} before, {load_after:.1f} after (a machine shared with other work:"
            " ratios"
            " are the result, absolute times are noisy).",
            "",
            "| measurement | result | notes |",
            "|---|---|---|",
            *lines,
            "",
            f"Command: `{shlex.join(['python', 'bench/cache_protection.py', *sys.argv[1:]])}`",
        ]
    )
    print(body)
    replace_section(REPO / "docs" / "benchmarks.md", "cache-protection", body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

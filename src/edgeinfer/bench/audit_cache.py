"""`edgeinfer audit-cache`: does a server's prompt cache let one tenant see another's prompts?

    edgeinfer audit-cache --base-url http://127.0.0.1:8000 --key-a K1 --key-b K2 --num-prompts 30

For each of N fresh prompts with a long prefix: tenant A sends it once (it is now in A's cache), then, in
random order, the time to first token of (a) A repeating it, (b) B sending it, (c) B sending a never-seen
prompt of the same length. ROC AUC of (b) vs (c) near 0.5 means B cannot tell A's prompts from new ones;
(a) vs (c) is the control: near 1.0 shows the server caches at all (with caching off, (b) vs (c) passes
too, and proves nothing). A Kolmogorov–Smirnov test gives each comparison a p-value.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import asdict, dataclass

import httpx

from edgeinfer.bench.audit_stats import ks_test, roc_auc

_WORDS = (
    "river",
    "stone",
    "cloud",
    "amber",
    "signal",
    "orbit",
    "lantern",
    "meadow",
    "copper",
    "harbor",
    "violet",
    "engine",
    "whisper",
    "canyon",
    "falcon",
    "ember",
    "glacier",
    "prism",
    "thunder",
    "willow",
    "cobalt",
    "summit",
    "marble",
    "tundra",
    "beacon",
    "saffron",
    "quartz",
)


@dataclass
class AuditResult:
    same_tenant_ttft_s: list[float]
    other_tenant_ttft_s: list[float]
    unseen_ttft_s: list[float]
    auc_other_vs_unseen: float
    auc_same_vs_unseen: float
    ks_other_vs_unseen: tuple[float, float]
    ks_same_vs_unseen: tuple[float, float]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    p.add_argument("--key-a", required=True, help="API key of tenant A")
    p.add_argument("--key-b", required=True, help="API key of tenant B (another tenant)")
    p.add_argument("--model", default=None, help="model id (default: the server's first)")
    p.add_argument("--num-prompts", type=int, default=30)
    p.add_argument("--prefix-words", type=int, default=600, help="length of each fresh prompt, in words")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default=None, metavar="FILE")


def fresh_prompt(rng: random.Random, words: int) -> str:
    """Random words behind a random nonce, so no server has seen it (nor a prefix of it)."""
    return f"{rng.getrandbits(64):016x} " + " ".join(rng.choice(_WORDS) for _ in range(words))


async def ttft(client: httpx.AsyncClient, model: str, key: str, prompt: str) -> float:
    """Seconds from sending to the first streamed text of a one-token completion."""
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": True}
    headers = {"Authorization": f"Bearer {key}"}
    start = time.perf_counter()
    async with client.stream("POST", "/v1/completions", json=body, headers=headers) as response:
        if response.status_code >= 400:
            raise ValueError(
                f"the server answered {response.status_code}: {(await response.aread())[:300]!r}"
            )
        async for line in response.aiter_lines():
            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                return time.perf_counter() - start
    raise ValueError("the server's stream ended without a token")


async def _model(client: httpx.AsyncClient, key: str) -> str:
    response = await client.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
    response.raise_for_status()
    return str(response.json()["data"][0]["id"])


async def audit(
    base_url: str, key_a: str, key_b: str, model: str | None, n: int, words: int, seed: int
) -> AuditResult:
    rng = random.Random(seed)
    same, other, unseen = [], [], []
    async with httpx.AsyncClient(base_url=base_url.rstrip("/"), timeout=300.0) as client:
        model = model or await _model(client, key_a)
        await ttft(client, model, key_a, fresh_prompt(rng, words))  # warm-up, not counted
        for _ in range(n):
            prompt = fresh_prompt(rng, words)
            await ttft(client, model, key_a, prompt)  # A's first visit: now in A's cache
            probes = [("a", key_a, prompt), ("b", key_b, prompt), ("c", key_b, fresh_prompt(rng, words))]
            rng.shuffle(probes)
            for kind, key, text in probes:
                t = await ttft(client, model, key, text)
                {"a": same, "b": other, "c": unseen}[kind].append(t)
    return AuditResult(
        same, other, unseen,
        roc_auc(other, unseen), roc_auc(same, unseen),
        ks_test(other, unseen), ks_test(same, unseen),
    )  # fmt: skip


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def report(result: AuditResult) -> str:
    rows = [
        f"TTFT p50 ms: same-tenant repeat {_median(result.same_tenant_ttft_s) * 1e3:.1f}, "
        f"other-tenant repeat {_median(result.other_tenant_ttft_s) * 1e3:.1f}, "
        f"never seen {_median(result.unseen_ttft_s) * 1e3:.1f}",
        f"cross-tenant (b vs c): AUC {result.auc_other_vs_unseen:.3f}, "
        f"KS D {result.ks_other_vs_unseen[0]:.3f} p {result.ks_other_vs_unseen[1]:.3g}",
        f"control (a vs c):      AUC {result.auc_same_vs_unseen:.3f}, "
        f"KS D {result.ks_same_vs_unseen[0]:.3f} p {result.ks_same_vs_unseen[1]:.3g}",
    ]
    if result.auc_same_vs_unseen < 0.9:
        rows.append("the control shows no caching: the cross-tenant result proves nothing")
    return "\n".join(rows)


def run(args: argparse.Namespace) -> int:
    if args.num_prompts < 2:
        raise ValueError("--num-prompts must be at least 2")
    try:
        result = asyncio.run(
            audit(
                args.base_url,
                args.key_a,
                args.key_b,
                args.model,
                args.num_prompts,
                args.prefix_words,
                args.seed,
            )
        )
    except httpx.HTTPError as exc:
        print(f"edgeinfer audit-cache: error: {args.base_url}: {exc!r}", file=sys.stderr)
        return 2
    print(report(result))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(asdict(result), f, indent=2)
    return 0

"""Speculative decoding through the node's API: on for every request of a node started with it (same output
as without), off for a request that says `"speculative": false`."""

from __future__ import annotations

import dataclasses

import httpx
import pytest
from helpers.node_engine import TEST_ENGINE

SPEC_ENGINE = dataclasses.replace(
    TEST_ENGINE, speculative_method="ngram", num_speculative_tokens=4, ngram_min=1, ngram_max=3
)
# Most of the tiny vocabulary once: every token the model then says was said before, so drafts follow
PROMPT = list(range(3, 380))


@pytest.fixture(scope="module")
def node(module_node_factory, tiny_llama_dir):
    return module_node_factory({"tiny": tiny_llama_dir}, preload=("tiny",), engine=SPEC_ENGINE)


def _drafted(node) -> int:
    return node.engine("tiny").stats().spec_drafted_by_source.get("ngram", 0)


def _complete(node, **extra: object) -> list[int]:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    r = httpx.post(node.url + "/v1/completions", json={**body, **extra}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_a_request_may_opt_out_of_speculation(node):
    before = _drafted(node)
    plain = _complete(node, speculative=False)
    assert _drafted(node) == before
    assert _complete(node) == plain
    assert _drafted(node) > before
    bad = httpx.post(node.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "speculative": "no"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "speculative"

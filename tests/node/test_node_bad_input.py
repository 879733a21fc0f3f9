"""Bad input gets a clear message in OpenAI's error shape on /v1, with the right status."""

from __future__ import annotations

import httpx
import pytest


def _post(node, path: str, **kw) -> httpx.Response:
    return httpx.post(node.url + path, **kw)


@pytest.mark.parametrize(
    ("payload", "status", "needle"),
    [
        ({"model": "nope", "prompt": "x"}, 404, "nope"),
        ({"model": "tiny", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ({"model": "tiny", "prompt": "x", "temperature": "hot"}, 400, "temperature"),
        ({"model": "tiny", "prompt": "x", "n": 9}, 400, "n × prompts"),
        ({"model": "tiny", "prompt": "x", "logprobs": 21}, 400, "logprobs"),
        ({"model": "tiny", "prompt": "x", "stop": ["a"] * 17}, 400, "stop"),
        ({"model": "tiny", "prompt": "x", "max_tokens": 5000}, 400, "max_tokens"),
        ({"model": "tiny", "prompt": "x", "max_tokens": 600}, 400, "context length"),
        ({"model": "tiny", "prompt": [999999]}, 400, "vocabulary"),
        ({"model": "tiny", "prompt": "x", "logit_bias": {"1": 5}}, 400, "logit_bias"),
        ({"prompt": "x"}, 400, "model"),
    ],
)
def test_completion_errors(shared_node, payload: dict, status: int, needle: str) -> None:
    r = _post(shared_node, "/v1/completions", json=payload)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert needle in error["message"]


def test_invalid_json_is_400(shared_node) -> None:
    r = _post(
        shared_node,
        "/v1/chat/completions",
        content=b'{"model": "tiny", "messages": [',
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400
    assert r.json()["error"]["message"].startswith("invalid JSON body")


def test_chat_rejects_what_it_cannot_honour(shared_node) -> None:
    base = {"model": "tiny", "messages": [{"role": "user", "content": "x"}]}
    tools = _post(shared_node, "/v1/chat/completions", json={**base, "tools": [{"type": "function"}]})
    assert tools.status_code == 400 and "tools" in tools.json()["error"]["message"]
    image = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
    r = _post(shared_node, "/v1/chat/completions", json={**base, "messages": [image]})
    assert r.status_code == 400 and "text" in r.json()["error"]["message"]
    bad_role = _post(
        shared_node, "/v1/chat/completions", json={**base, "messages": [{"role": "x", "content": "y"}]}
    )
    assert bad_role.status_code == 400 and bad_role.json()["error"]["param"].startswith("messages")


def test_body_too_large_is_413(node_factory, tiny_llama_dir) -> None:
    node = node_factory({"tiny": tiny_llama_dir}, max_body_bytes=1000)
    r = _post(node, "/v1/completions", json={"model": "tiny", "prompt": "x" * 2000})
    assert r.status_code == 413 and "1000 bytes" in r.json()["error"]["message"]
    small = _post(node, "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1})
    assert small.status_code == 200


def test_prompt_token_limit(node_factory, tiny_llama_dir) -> None:
    node = node_factory({"tiny": tiny_llama_dir}, max_prompt_tokens=8)
    r = _post(node, "/v1/completions", json={"model": "tiny", "prompt": list(range(3, 13)), "max_tokens": 1})
    assert r.status_code == 400 and "limit of 8" in r.json()["error"]["message"]


def test_unknown_route_uses_openai_shape(shared_node) -> None:
    r = httpx.get(shared_node.url + "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


def test_openapi_lists_the_routes(shared_node) -> None:
    paths = httpx.get(shared_node.url + "/openapi.json").json()["paths"]
    for path in (
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/models",
        "/v1/usage",
        "/health",
        "/ready",
        "/metrics",
        "/accounts/{account_id}/ai/run/{model}",
    ):
        assert path in paths

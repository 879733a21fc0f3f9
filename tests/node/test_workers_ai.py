"""The Workers-AI route: envelope, SSE, model names with slashes, errors in the envelope."""

from __future__ import annotations

import json

import httpx

ROUTE = "/accounts/acct123/ai/run/"


def _sse_payloads(text: str) -> list[str]:
    return [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]


def test_prompt_envelope(shared_node) -> None:
    r = httpx.post(shared_node.url + ROUTE + "@cf/test/tiny", json={"prompt": "Hello", "max_tokens": 4})
    assert r.status_code == 200
    body = r.json()
    assert body["success"] is True and body["errors"] == [] and body["messages"] == []
    assert isinstance(body["result"]["response"], str)
    usage = body["result"]["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert 1 <= usage["completion_tokens"] <= 4


def test_messages_and_raw_prompt(shared_node) -> None:
    messages = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]}
    r = httpx.post(shared_node.url + ROUTE + "tiny", json={**messages, "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["success"]
    raw = httpx.post(shared_node.url + ROUTE + "tiny", json={"prompt": "Hi", "raw": True, "max_tokens": 3})
    templated = httpx.post(shared_node.url + ROUTE + "tiny", json={"prompt": "Hi", "max_tokens": 3})
    # raw skips the chat template, so the prompt is shorter
    assert (
        raw.json()["result"]["usage"]["prompt_tokens"] < templated.json()["result"]["usage"]["prompt_tokens"]
    )


def test_stream(shared_node) -> None:
    payload = {"prompt": "Edge inference", "max_tokens": 5, "temperature": 0, "seed": 1}
    whole = httpx.post(shared_node.url + ROUTE + "tiny", json=payload).json()["result"]
    r = httpx.post(shared_node.url + ROUTE + "tiny", json={**payload, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = _sse_payloads(r.text)
    assert events[-1] == "[DONE]"
    parsed = [json.loads(e) for e in events[:-1]]
    assert "".join(p["response"] for p in parsed) == whole["response"]
    assert parsed[-1]["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"]


def test_errors_use_the_envelope(shared_node) -> None:
    missing = httpx.post(shared_node.url + ROUTE + "@cf/nope/model", json={"prompt": "x"})
    assert missing.status_code == 404
    body = missing.json()
    assert body["success"] is False and body["result"] is None
    assert body["errors"][0]["code"] == 5007 and "@cf/nope/model" in body["errors"][0]["message"]
    neither = httpx.post(shared_node.url + ROUTE + "tiny", json={"max_tokens": 3})
    assert neither.status_code == 400 and "prompt" in neither.json()["errors"][0]["message"]
    bad_type = httpx.post(shared_node.url + ROUTE + "tiny", json={"prompt": "x", "max_tokens": "many"})
    assert bad_type.status_code == 400
    assert bad_type.json()["errors"][0]["message"].startswith("max_tokens")


def test_reject_if_busy_on_cold_model_starts_loading(node_factory, tiny_llama_dir) -> None:
    node = node_factory({"cold": tiny_llama_dir})
    payload = {"prompt": "Hi", "max_tokens": 2, "options": {"rejectIfBusy": True}}
    r = httpx.post(node.url + ROUTE + "cold", json=payload)
    assert r.status_code == 429
    assert r.json()["errors"][0]["code"] == 3040 and "Retry-After" in r.headers
    # the rejection started the load, so a retry shortly after finds the model warm
    for _ in range(200):
        r = httpx.post(node.url + ROUTE + "cold", json=payload)
        if r.status_code == 200:
            break
    assert r.status_code == 200 and r.json()["success"]

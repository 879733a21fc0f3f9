"""What a hostile but fair client found (issue 23): bad seeds, undecodable text, wrong JSON types, fields a
route cannot honour, request ids and forwarded addresses. Each answer is a 4xx in the route's shape."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time

import httpx
import pytest

from edgeinfer.obs.access_log import ACCESS_LOGGER

WAI = "/accounts/acct/ai/run/tiny"
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}


def _post(node, path: str, body: dict, **kw) -> httpx.Response:
    # json.dumps escapes a lone surrogate as \ud800, which is valid JSON (httpx's own encoder would refuse it)
    return httpx.post(
        node.url + path, content=json.dumps(body), headers={"content-type": "application/json"}, **kw
    )


def _error_message(r: httpx.Response, path: str) -> str:
    body = r.json()
    if path.startswith("/accounts/"):
        assert body["success"] is False and body["result"] is None
        return body["errors"][0]["message"]
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]["message"]


def test_seeds_outside_the_engine_range_never_reach_it(shared_node) -> None:
    long = {"model": "tiny", "prompt": "Edge", "max_tokens": 200, "ignore_eos": True, "temperature": 0}

    async def main() -> tuple[httpx.Response, list[httpx.Response]]:
        async with httpx.AsyncClient(base_url=shared_node.url, timeout=60) as client:
            running = asyncio.create_task(client.post("/v1/completions", json={**long, "stream": True}))
            deadline = time.monotonic() + 30
            while shared_node.engine("tiny").stats().num_running == 0:  # the long one is decoding
                assert time.monotonic() < deadline, "the long request never started"
                await asyncio.sleep(0.01)
            seeds = [
                client.post("/v1/completions", json={**long, "max_tokens": 2, "seed": 2**64}),
                client.post("/v1/completions", json={**long, "max_tokens": 2, "seed": -(2**63) - 1}),
                client.post(WAI, json={"prompt": "x", "max_tokens": 2, "seed": 2**64}),
                client.post("/v1/completions", json={**long, "max_tokens": 2, "seed": 2**64 - 1, "n": 2}),
            ]
            return await running, await asyncio.gather(*seeds)

    stream, answers = asyncio.run(main())
    assert [r.status_code for r in answers] == [400, 400, 400, 200]  # n-derived seeds wrap around
    assert "seed" in answers[0].json()["error"]["param"]
    events = [line[6:] for line in stream.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and '"error"' not in stream.text
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(
    ("path", "body", "status"),
    [
        ("/v1/completions", {"model": "tiny", "prompt": "a\ud800b", "max_tokens": 2}, 400),
        ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "a\ud800"}]}, 400),
        (WAI, {"prompt": "a\udfff", "max_tokens": 2}, 400),
        (WAI, {"messages": [], "max_tokens": 2}, 400),
        (
            WAI,
            {
                "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
                "max_tokens": 2,
            },
            400,
        ),
        (
            "/v1/chat/completions",
            {
                **CHAT,
                "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            },
            400,
        ),
        ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": True}, 400),
        (WAI, {"prompt": "x", "max_tokens": True}, 400),
        ("/v1/completions", {"model": "tiny", "prompt": "x", "n": "2"}, 400),
        ("/v1/completions", {"model": "tiny", "prompt": [5, True]}, 400),
        ("/v1/completions", {"model": "tiny", "prompt": "x", "top_k": 2**63}, 400),
    ],
)
def test_bad_input_is_a_4xx_in_the_route_shape(shared_node, path: str, body: dict, status: int) -> None:
    r = _post(shared_node, path, body)
    assert r.status_code == status, r.text
    assert _error_message(r, path)


@pytest.mark.parametrize(
    ("path", "field", "value"),
    [(path, "response_format", {"type": "xml"}) for path in ("/v1/chat/completions", "/v1/completions", WAI)]
    + [
        (path, "tools", [{"type": "function", "function": {"name": "f"}}])
        for path in ("/v1/completions", WAI)
    ],
)
def test_every_route_refuses_what_it_cannot_honour(shared_node, path: str, field: str, value) -> None:
    body = {"model": "tiny", "prompt": "x", "messages": CHAT["messages"], "max_tokens": 2}
    if path == WAI:
        del body["model"], body["messages"]
    r = _post(shared_node, path, {**body, field: value})
    assert r.status_code == 400
    assert field.split("_")[0] in _error_message(r, path)


def test_workers_ai_body_too_large_is_code_3006(shared_node) -> None:
    r = httpx.post(shared_node.url + WAI, content=b"x" * (4 * 1024 * 1024 + 1))
    assert r.status_code == 413 and r.json()["errors"][0]["code"] == 3006


def test_unexpected_errors_are_a_generic_500_with_the_request_id(shared_node, monkeypatch) -> None:
    def broken(*args: object) -> str:
        raise RuntimeError("secret internals")

    monkeypatch.setattr(shared_node.service, "_generation_target", broken)
    with httpx.Client(base_url=shared_node.url) as client:
        r = client.post("/v1/completions", json={"model": "tiny", "prompt": "x"})
        assert r.status_code == 500
        message = r.json()["error"]["message"]
        assert r.headers["x-request-id"] in message and "secret" not in r.text
        assert client.get("/health").status_code == 200  # the connection was answered, not reset


def test_every_response_carries_a_request_id(node_factory, tiny_llama_dir, make_tenant) -> None:
    node = node_factory(
        {"tiny": tiny_llama_dir},
        tenants=[make_tenant("t", "key-1", requests_per_minute=1)],
        max_body_bytes=10_000,
    )
    auth = {"authorization": "Bearer key-1"}
    with httpx.Client(base_url=node.url, timeout=60) as c:
        answers = {
            200: c.post(
                "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1}, headers=auth
            ),
            429: c.post("/v1/completions", json={"model": "tiny", "prompt": "x"}, headers=auth),
            401: c.get("/v1/models"),
            400: c.post(
                "/v1/completions", content=b"{", headers={**auth, "content-type": "application/json"}
            ),
            404: c.get("/nothing"),
            413: c.post("/v1/completions", content=b"x" * 10_001, headers=auth),
            "bad field": c.post("/v1/completions", json={"prompt": 1}, headers=auth),
            "models": c.get("/v1/models", headers=auth),
            "usage": c.get("/v1/usage", headers=auth),
            "health": c.get("/health"),
            "metrics": c.get("/metrics"),
        }
        kept = c.get("/health", headers={"x-request-id": "trace-42.a:b"})
        replaced = c.get("/health", headers={"x-request-id": "not ok" + "!" * 200})
    for key, r in answers.items():
        assert r.status_code == (key if isinstance(key, int) else 400 if key == "bad field" else 200), key
        assert re.fullmatch("[0-9a-f]{32}", r.headers["x-request-id"]), key
    assert len({r.headers["x-request-id"] for r in answers.values()}) == len(answers)
    assert kept.headers["x-request-id"] == "trace-42.a:b"
    assert re.fullmatch("[0-9a-f]{32}", replaced.headers["x-request-id"])


@pytest.mark.parametrize(("trusted", "client"), [((), "127.0.0.1"), (("127.0.0.1",), "203.0.113.9")])
def test_forwarded_for_is_believed_only_from_trusted_proxies(
    node_factory, tiny_llama_dir, caplog, trusted: tuple[str, ...], client: str
) -> None:
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    node = node_factory({"tiny": tiny_llama_dir}, trusted_proxies=trusted)
    r = httpx.get(node.url + "/health", headers={"x-forwarded-for": "203.0.113.9", "x-request-id": "xff-1"})
    assert r.status_code == 200

    def logged() -> list[dict]:  # the line is written once the response is out, which may be a moment later
        lines = [json.loads(rec.message) for rec in caplog.records if rec.name == ACCESS_LOGGER]
        return [entry for entry in lines if entry.get("request_id") == "xff-1"]

    deadline = time.monotonic() + 5
    while not logged() and time.monotonic() < deadline:
        time.sleep(0.02)
    (line,) = logged()
    assert line["client"] == client

"""schemathesis against a live node on loopback serving the tiny engine: every answer has a declared status
and matches its declared schema, schema-violating bodies are refused, undeclared methods get 405 with Allow.

All checks but `positive_data_acceptance`: a body the schema allows may still be refused with a 400 for what
no JSON schema can say (a prompt longer than the model's context, token ids outside its vocabulary, a
tool_choice naming an undeclared tool, an empty prompt)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

pytest.importorskip("schemathesis")


def test_schemathesis_finds_nothing(shared_node, tmp_path: Path) -> None:
    cmd = [
        str(Path(sys.executable).with_name("schemathesis")),
        "run",
        f"{shared_node.url}/openapi.json",
        "--checks",
        "all",
        "--exclude-checks",
        "positive_data_acceptance",
        "--max-examples",
        "8",
        "--seed",
        "1",
        "--request-timeout",
        "20",
        "--no-color",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-20000:] + done.stderr[-2000:]


def test_schema_declares_errors_oneof_and_405_has_allow(shared_node) -> None:
    schema = httpx.get(f"{shared_node.url}/openapi.json").json()
    run = schema["paths"]["/accounts/{account_id}/ai/run/{model}"]["post"]
    assert {"400", "401", "404", "405", "408", "413", "422", "429", "500", "503"} <= set(run["responses"])
    busy = run["responses"]["429"]["content"]["application/json"]["schema"]
    assert busy["$ref"].endswith("/WorkersAIError")
    chat = schema["paths"]["/v1/chat/completions"]["post"]["responses"]["422"]
    assert chat["content"]["application/json"]["schema"]["$ref"].endswith("/OpenAIError")
    body = schema["components"]["schemas"]["WorkersAIRunRequest"]
    assert [alt["required"] for alt in body["oneOf"]] == [["prompt"], ["messages"], ["text"]]
    both = httpx.post(f"{shared_node.url}/accounts/a/ai/run/tiny", json={"prompt": "hi", "text": "hi"})
    assert both.status_code == 400 and "exactly one" in both.json()["errors"][0]["message"]
    wrong = httpx.delete(f"{shared_node.url}/v1/chat/completions")
    assert wrong.status_code == 405 and wrong.headers["allow"] == "POST"
    assert wrong.json()["error"]["code"] == "method_not_allowed"


WAI = "/accounts/a/ai/run/tiny"
BODIES = {
    "/v1/completions": {"model": "tiny", "prompt": "Hello"},
    "/v1/chat/completions": {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}]},
    WAI: {"prompt": "Hello"},
}


@pytest.mark.parametrize("path", list(BODIES))
def test_a_number_without_a_fraction_is_an_integer_as_the_schema_says(shared_node, path: str) -> None:
    """JSON Schema's `integer` (what /openapi.json declares) includes 4.0: served as 4; 4.5 is refused."""

    def post(**fields: object) -> httpx.Response:
        body = {**BODIES[path], "temperature": 0, **fields}
        return httpx.post(shared_node.url + path, json=body, timeout=60)

    whole, as_float = post(max_tokens=4, seed=7), post(max_tokens=4.0, seed=7.0)
    assert (whole.status_code, as_float.status_code) == (200, 200), as_float.text
    assert _text(as_float.json()) == _text(whole.json())
    assert post(max_tokens=4.5).status_code == 422


@pytest.mark.parametrize("path", list(BODIES))
def test_the_seed_bound_is_exact(shared_node, path: str) -> None:
    """2**64 - 1 is the largest seed; one above it (which equals it as a float) is refused."""
    statuses = [
        httpx.post(shared_node.url + path, json={**BODIES[path], "max_tokens": 1, "seed": seed}).status_code
        for seed in (2**64 - 1, 2**64, 2**64 + 1, float(2**64))
    ]
    assert statuses == [200, 422, 422, 422]


def test_the_schema_states_integer_bounds_exactly(shared_node) -> None:
    """Every bound of an integer is a JSON integer, `minimum` / `maximum` (not pydantic's `ge` / `le`, which
    JSON Schema readers ignore), and the seed's maximum is 2**64 - 1, not its float 2**64."""
    schema = httpx.get(f"{shared_node.url}/openapi.json").json()
    integers = [s for s in _objects(schema) if s.get("type") == "integer"]
    keywords = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
    bounds = [s[k] for s in integers for k in keywords if k in s]
    assert bounds and all(type(bound) is int for bound in bounds)
    assert not any({"ge", "gt", "le", "lt"} & set(s) for s in _objects(schema))
    seed = schema["components"]["schemas"]["CompletionRequest"]["properties"]["seed"]["anyOf"][0]
    assert (seed["minimum"], seed["maximum"]) == (0, 2**64 - 1)


def _text(body: dict) -> str:
    if "choices" in body:
        choice = body["choices"][0]
        return choice["text"] if "text" in choice else choice["message"]["content"]
    return body["result"]["response"]


def _objects(value: object) -> list[dict]:
    """Every JSON object inside a JSON value, itself included."""
    if isinstance(value, dict):
        return [value, *(o for inner in value.values() for o in _objects(inner))]
    if isinstance(value, list):
        return [o for inner in value for o in _objects(inner)]
    return []

"""schemathesis against a live node on loopback serving the tiny engine: every answer has a declared status
and content type and matches its declared schema (each event of a stream too), schema-violating bodies are
refused, undeclared methods get 405 with Allow.

Bodies name the served model, so they reach validation and generation rather than a 404. A body the schema
allows may still be refused (`positive_data_acceptance` with every status of a served request allowed): with
a 400 for what no JSON schema can say (a prompt longer than the model's context, token ids outside its
vocabulary, a tool_choice naming an undeclared tool, an empty prompt, more tokens than the node's limit).
Validation errors are 400s too, as OpenAI answers them, so this check cannot tell the two apart; the
schema's bounds are checked one by one below."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from helpers.node_servers import LiveServer, NodeFactory

pytest.importorskip("schemathesis")

# schemathesis.toml: the served model's name in every body and path, and what a schema-valid body may get.
CONFIG = """
[parameters]
"body.model" = "tiny"
"path.model" = "tiny"

[checks.positive_data_acceptance]
expected-statuses = ["2XX", "400", "401", "403", "404", "413", "429", "503"]
"""


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: str) -> Iterator[LiveServer]:
    """The tiny model, preloaded, with answers of at most 8 tokens so generated requests finish fast."""
    factory = NodeFactory(tmp_path_factory.mktemp("schemathesis-node"))
    server = factory(
        {"tiny": tiny_llama_dir}, preload=("tiny",), max_tokens=8, workers_ai_default_max_tokens=8
    )
    yield server
    server.stop()


def test_schemathesis_finds_nothing(node, tmp_path: Path) -> None:
    cmd = [
        str(Path(sys.executable).with_name("schemathesis")),
        "run",
        f"{node.url}/openapi.json",
        "--checks",
        "all",
        "--max-examples",
        "8",
        "--seed",
        "1",
        "--request-timeout",
        "20",
        "--no-color",
    ]
    (tmp_path / "schemathesis.toml").write_text(CONFIG)  # read from the working directory
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-20000:] + done.stderr[-2000:]


def test_schema_declares_errors_oneof_and_405_has_allow(node) -> None:
    schema = httpx.get(f"{node.url}/openapi.json").json()
    run = schema["paths"]["/accounts/{account_id}/ai/run/{model}"]["post"]
    assert {"400", "401", "404", "405", "408", "413", "429", "500", "503"} <= set(run["responses"])
    busy = run["responses"]["429"]["content"]["application/json"]["schema"]
    assert busy["$ref"].endswith("/WorkersAIError")
    chat = schema["paths"]["/v1/chat/completions"]["post"]["responses"]["400"]
    assert chat["content"]["application/json"]["schema"]["$ref"].endswith("/OpenAIError")
    # Validation errors are 400s (as OpenAI's and vLLM's), so no route declares FastAPI's 422.
    assert not [op for ops in schema["paths"].values() for op in ops.values() if "422" in op["responses"]]
    body = schema["components"]["schemas"]["WorkersAIRunRequest"]
    assert [alt["required"] for alt in body["oneOf"]] == [["prompt"], ["messages"], ["text"]]
    both = httpx.post(f"{node.url}/accounts/a/ai/run/tiny", json={"prompt": "hi", "text": "hi"})
    assert both.status_code == 400 and "exactly one" in both.json()["errors"][0]["message"]
    for path in ("/v1/completions", "/v1/chat/completions", "/accounts/{account_id}/ai/run/{model}"):
        assert "text/event-stream" in schema["paths"][path]["post"]["responses"]["200"]["content"]
    wrong = httpx.delete(f"{node.url}/v1/chat/completions")
    assert wrong.status_code == 405 and wrong.headers["allow"] == "POST"
    assert wrong.json()["error"]["code"] == "method_not_allowed"
    # A path with a route per method: the 405 names every route's methods, each operation its own id.
    two = httpx.delete(f"{node.url}/accounts/a/ai/finetunes")
    assert two.status_code == 405 and two.headers["allow"] == "GET, POST"
    ops = schema["paths"]["/accounts/{account_id}/ai/finetunes"]
    assert ops["get"]["operationId"] != ops["post"]["operationId"]


WAI = "/accounts/a/ai/run/tiny"
BODIES = {
    "/v1/completions": {"model": "tiny", "prompt": "Hello"},
    "/v1/chat/completions": {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}]},
    WAI: {"prompt": "Hello"},
}


@pytest.mark.parametrize("path", list(BODIES))
def test_a_number_without_a_fraction_is_an_integer_as_the_schema_says(node, path: str) -> None:
    """JSON Schema's `integer` (what /openapi.json declares) includes 4.0: served as 4; 4.5 is refused."""

    def post(**fields: object) -> httpx.Response:
        body = {**BODIES[path], "temperature": 0, **fields}
        return httpx.post(node.url + path, json=body, timeout=60)

    whole, as_float = post(max_tokens=4, seed=7), post(max_tokens=4.0, seed=7.0)
    assert (whole.status_code, as_float.status_code) == (200, 200), as_float.text
    assert _text(as_float.json()) == _text(whole.json())
    assert post(max_tokens=4.5).status_code == 400


@pytest.mark.parametrize("path", list(BODIES))
def test_the_seed_bound_is_exact(node, path: str) -> None:
    """2**64 - 1 is the largest seed; one above it (which equals it as a float) is refused."""
    statuses = [
        httpx.post(node.url + path, json={**BODIES[path], "max_tokens": 1, "seed": seed}).status_code
        for seed in (2**64 - 1, 2**64, 2**64 + 1, float(2**64))
    ]
    assert statuses == [200, 400, 400, 400]


def test_the_schema_states_integer_bounds_exactly(node) -> None:
    """Every bound of an integer is a JSON integer, `minimum` / `maximum` (not pydantic's `ge` / `le`, which
    JSON Schema readers ignore), and the seed's maximum is 2**64 - 1, not its float 2**64."""
    schema = httpx.get(f"{node.url}/openapi.json").json()
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

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

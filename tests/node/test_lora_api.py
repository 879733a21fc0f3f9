"""LoRA adapters through the node: `model: "base:adapter"` (OpenAI routes), Workers AI's `lora`, adapters
per tenant from the tenants file (another tenant's is a 404 like a missing one), and `/v1/models`."""

from __future__ import annotations

import dataclasses

import httpx
import pytest
from helpers.lora import make_adapter
from helpers.node_engine import TEST_ENGINE

from edgeinfer.api.keys import hash_key
from edgeinfer.engine.engine import LLMEngine
from edgeinfer.types import SamplingParams

KEY_A, KEY_B = "ei-lora-a", "ei-lora-b"
PROMPT = "The quick brown fox"


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def adapter_dirs(tiny_llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("node-adapters")
    make_adapter(tiny_llama_dir, root / "good", ["q_proj", "v_proj", "down_proj"], seed=3)
    make_adapter(tiny_llama_dir, root / "big", ["q_proj"], r=8)
    cfg = (root / "big" / "adapter_config.json").read_text()
    (root / "big" / "adapter_config.json").write_text(cfg.replace('"r": 8', '"r": 80'))
    return {"good": str(root / "good"), "big": str(root / "big")}


@pytest.fixture(scope="module")
def lora_node(module_node_factory, tiny_llama_dir, adapter_dirs):
    alpha = {"name": "alpha", "key_sha256": hash_key(KEY_A)}
    alpha["adapters"] = [
        {"name": "support", "model": "tiny", "path": adapter_dirs["good"]},
        {"name": "huge", "model": "tiny", "path": adapter_dirs["big"]},
    ]
    return module_node_factory(
        {"tiny": tiny_llama_dir},
        aliases={"tiny": ("@cf/test/tiny",)},
        tenants=[alpha, {"name": "beta", "key_sha256": hash_key(KEY_B)}],
        preload=("tiny",),
    )


def _expected(model_dir: str, adapter_dir: str | None) -> str:
    """The engine's own greedy answer, offline, as the node's engine is configured in the tests."""
    engine = LLMEngine(dataclasses.replace(TEST_ENGINE, model=model_dir))
    if adapter_dir is not None:
        engine.load_adapter("x", adapter_dir)
    ids = engine.tokenizer.encode(PROMPT)
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    return engine.generate([ids], sp, "x" if adapter_dir else None)[0].text


def _complete(node, model: str, key: str) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    return httpx.post(node.url + "/v1/completions", json=body, headers=_auth(key), timeout=60)


def test_openai_and_workers_ai_serve_the_tenants_adapter(lora_node, tiny_llama_dir, adapter_dirs):
    base = _complete(lora_node, "tiny", KEY_A)
    tuned = _complete(lora_node, "tiny:support", KEY_A)
    assert base.status_code == 200 and tuned.status_code == 200, tuned.text
    assert base.json()["choices"][0]["text"] == _expected(tiny_llama_dir, None)
    assert tuned.json()["choices"][0]["text"] == _expected(tiny_llama_dir, adapter_dirs["good"])
    assert tuned.json()["choices"][0]["text"] != base.json()["choices"][0]["text"]
    body = {"prompt": PROMPT, "raw": True, "max_tokens": 8, "temperature": 0, "lora": "support"}
    wai = httpx.post(lora_node.url + "/accounts/a/ai/run/@cf/test/tiny", json=body, headers=_auth(KEY_A))
    assert wai.status_code == 200, wai.text
    assert wai.json()["result"]["response"] == tuned.json()["choices"][0]["text"]


def test_another_tenants_adapter_is_the_404_of_a_missing_one(lora_node):
    theirs, missing = _complete(lora_node, "tiny:support", KEY_B), _complete(lora_node, "tiny:nope", KEY_A)
    assert theirs.status_code == missing.status_code == 404
    assert theirs.json()["error"]["code"] == missing.json()["error"]["code"] == "model_not_found"
    body = {"prompt": PROMPT, "lora": "support"}
    wai = httpx.post(lora_node.url + "/accounts/a/ai/run/tiny", json=body, headers=_auth(KEY_B))
    assert wai.status_code == 404


def test_an_adapter_the_base_cannot_serve_is_a_400(lora_node):
    bad = _complete(lora_node, "tiny:huge", KEY_A)
    assert bad.status_code == 400
    assert "rank r=80 is over the limit of 64" in bad.json()["error"]["message"]


def test_models_lists_the_callers_adapters_only(lora_node):
    ids_a = {m["id"] for m in httpx.get(lora_node.url + "/v1/models", headers=_auth(KEY_A)).json()["data"]}
    ids_b = {m["id"] for m in httpx.get(lora_node.url + "/v1/models", headers=_auth(KEY_B)).json()["data"]}
    assert {"tiny", "tiny:support", "tiny:huge"} <= ids_a
    assert "tiny" in ids_b and not any(":" in i for i in ids_b)


def test_tenants_file_adapters_are_checked_at_start(adapter_dirs, tmp_path):
    from edgeinfer.api.adapters import parse_adapters, split_model

    good = {"name": "support", "model": "tiny", "path": adapter_dirs["good"]}
    assert parse_adapters([good], "t")["support"].path == adapter_dirs["good"]
    for entry, match in [
        ({**good, "name": "a:b"}, "no ':'"),
        ({**good, "path": str(tmp_path)}, "lacks adapter_config.json, adapter_model.safetensors"),
        ({"name": "x", "model": "tiny"}, "exactly `name`, `model` and `path`"),
    ]:
        with pytest.raises(ValueError, match=match):
            parse_adapters([entry], "t")
    with pytest.raises(ValueError, match="duplicate"):
        parse_adapters([good, good], "t")
    assert split_model("tiny:support") == ("tiny", "support")
    assert split_model("@cf/test/tiny") == ("@cf/test/tiny", None)

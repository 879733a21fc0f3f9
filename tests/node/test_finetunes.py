"""Workers AI's finetunes API on a node without NATS: a tenant creates a finetune, uploads its PEFT files as
multipart assets, and requests then run it by name (`model: "base:name"`) or id (`lora`) with the output the
engine gives that adapter directory offline. Another tenant sees a 404 for all of it; bad uploads are 400s
that name the problem, an adapter the base cannot take among them (at the upload that completes it);
usage rows name the finetune's requests `base:name`."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import httpx
import pytest
from helpers.lora import make_adapter
from helpers.node_engine import TEST_ENGINE

from edgeinfer.api.keys import hash_key
from edgeinfer.engine.engine import LLMEngine
from edgeinfer.types import SamplingParams

KEY_A, KEY_B = "ei-ft-a", "ei-ft-b"
PROMPT = "The quick brown fox"
FILES = ("adapter_config.json", "adapter_model.safetensors")


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def adapter_dir(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ft-adapter") / "a"
    make_adapter(tiny_llama_dir, out, ["q_proj", "v_proj", "down_proj"], seed=5)
    return out


@pytest.fixture(scope="module")
def node(module_node_factory, tiny_llama_dir):
    tenants = [{"name": n, "key_sha256": hash_key(k)} for n, k in (("alpha", KEY_A), ("beta", KEY_B))]
    return module_node_factory(
        {"tiny": tiny_llama_dir}, aliases={"tiny": ("@cf/test/tiny",)}, tenants=tenants, preload=("tiny",)
    )


def _create(node, key: str, name: str, model: str = "@cf/test/tiny") -> httpx.Response:
    body = {"model": model, "name": name, "description": "support answers"}
    return httpx.post(f"{node.url}/accounts/x/ai/finetunes", json=body, headers=_auth(key), timeout=30)


def _upload(node, key: str, finetune: str, file_name: str, data: bytes) -> httpx.Response:
    return httpx.post(
        f"{node.url}/accounts/x/ai/finetunes/{finetune}/finetune-assets",
        files={"file": (file_name, data)},
        data={"file_name": file_name},
        headers=_auth(key),
        timeout=60,
    )


def _complete(node, key: str, model: str) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    return httpx.post(node.url + "/v1/completions", json=body, headers=_auth(key), timeout=60)


def _offline(model_dir: str, adapter: Path) -> str:
    engine = LLMEngine(dataclasses.replace(TEST_ENGINE, model=model_dir))
    engine.load_adapter("x", str(adapter))
    ids = engine.tokenizer.encode(PROMPT)
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    return engine.generate([ids], sp, "x")[0].text


def test_an_uploaded_finetune_serves_its_tenant_only(node, tiny_llama_dir, adapter_dir):
    created = _create(node, KEY_A, "support")
    assert created.status_code == 200, created.text
    finetune = created.json()["result"]
    assert finetune["name"] == "support" and finetune["model"] == "tiny"
    assert _complete(node, KEY_A, "tiny:support").status_code == 404  # no files yet
    for name in FILES:
        r = _upload(node, KEY_A, finetune["id"], name, (adapter_dir / name).read_bytes())
        assert r.status_code == 200, r.text
    assert r.json()["result"]["complete"] is True
    listed = httpx.get(f"{node.url}/accounts/x/ai/finetunes", headers=_auth(KEY_A)).json()["result"]
    assert [f["id"] for f in listed] == [finetune["id"]]

    tuned = _complete(node, KEY_A, "tiny:support")
    assert tuned.status_code == 200, tuned.text
    expected = _offline(tiny_llama_dir, adapter_dir)
    assert tuned.json()["choices"][0]["text"] == expected
    assert tuned.json()["choices"][0]["text"] != _complete(node, KEY_A, "tiny").json()["choices"][0]["text"]
    body = {"prompt": PROMPT, "raw": True, "max_tokens": 8, "temperature": 0, "lora": finetune["id"]}
    wai = httpx.post(f"{node.url}/accounts/x/ai/run/@cf/test/tiny", json=body, headers=_auth(KEY_A))
    assert wai.status_code == 200 and wai.json()["result"]["response"] == expected
    models = httpx.get(node.url + "/v1/models", headers=_auth(KEY_A)).json()["data"]
    assert "tiny:support" in {m["id"] for m in models}

    # another tenant: nothing listed, nothing to upload to, nothing to run
    assert httpx.get(f"{node.url}/accounts/x/ai/finetunes", headers=_auth(KEY_B)).json()["result"] == []
    theirs = _upload(node, KEY_B, finetune["id"], FILES[0], (adapter_dir / FILES[0]).read_bytes())
    assert theirs.status_code == 404
    assert _complete(node, KEY_B, "tiny:support").status_code == 404
    models_b = httpx.get(node.url + "/v1/models", headers=_auth(KEY_B)).json()["data"]
    assert not any(":" in m["id"] for m in models_b)

    usage = httpx.get(node.url + "/v1/usage", headers=_auth(KEY_A)).json()["data"]
    by_model = {row["model"]: row for row in usage}
    assert by_model["tiny:support"]["requests"] == 2 and by_model["tiny:support"]["output_tokens"] == 16


def test_bad_uploads_are_400s_that_say_why(node, adapter_dir):
    finetune = _create(node, KEY_A, "broken").json()["result"]
    config = json.loads((adapter_dir / FILES[0]).read_text())
    cases = [
        ("weights.bin", b"x", "file_name must be"),
        (FILES[0], b"{not json", "not valid JSON"),
        (FILES[0], json.dumps({**config, "r": 80}).encode(), "r must be an integer from 1 to 64"),
        (FILES[0], json.dumps({**config, "peft_type": "IA3"}).encode(), "peft_type 'LORA'"),
        (FILES[1], b"\x02\x00\x00\x00\x00\x00\x00\x00{x", "header is not JSON"),
        (FILES[1], b"\xff" * 16, "runs past the end"),
    ]
    for file_name, data, why in cases:
        r = _upload(node, KEY_A, finetune["id"], file_name, data)
        assert r.status_code == 400 and why in r.json()["error"]["message"], (file_name, r.text)
    plain = httpx.post(
        f"{node.url}/accounts/x/ai/finetunes/{finetune['id']}/finetune-assets",
        content=b"raw",
        headers=_auth(KEY_A),
    )
    assert plain.status_code == 400 and "multipart/form-data" in plain.json()["error"]["message"]
    assert _upload(node, KEY_A, "no-such-id", FILES[0], b"{}").status_code == 404

    # a module the base does not have: refused by the engine at the upload that completes the finetune
    wrong = {**config, "target_modules": ["q_proj", "c_attn"]}
    assert _upload(node, KEY_A, finetune["id"], FILES[0], json.dumps(wrong).encode()).status_code == 200
    done = _upload(node, KEY_A, finetune["id"], FILES[1], (adapter_dir / FILES[1]).read_bytes())
    assert done.status_code == 400 and "c_attn" in done.json()["error"]["message"], done.text


def test_create_checks_its_body(node):
    assert _create(node, KEY_A, "dup").status_code == 200
    again = _create(node, KEY_A, "dup")
    assert again.status_code == 400 and "exists" in again.json()["error"]["message"]
    assert _create(node, KEY_B, "dup").status_code == 200  # names are per account
    assert _create(node, KEY_A, "a:b").json()["error"]["param"] == "name"
    assert _create(node, KEY_A, "x", model="nope").status_code == 404
    not_an_object = httpx.post(f"{node.url}/accounts/x/ai/finetunes", json=[1], headers=_auth(KEY_A))
    assert not_an_object.status_code == 400
    assert httpx.get(f"{node.url}/accounts/x/ai/finetunes").status_code == 401

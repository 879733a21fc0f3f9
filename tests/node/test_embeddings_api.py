"""/v1/embeddings and Workers-AI text embeddings on a real server on loopback, with the real MiniLM."""

from __future__ import annotations

import base64
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
import torch
from helpers.embeddings import minilm_dir
from helpers.node_servers import LiveServer, NodeFactory

MODEL = "minilm"
ALIAS = "@cf/sentence-transformers/all-minilm-l6-v2"
TEXTS = ["The cat sat on the mat.", "Edge inference close to users.", "word " * 400]


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: str) -> Iterator[LiveServer]:
    factory = NodeFactory(tmp_path_factory.mktemp("embed-node"))
    models = {MODEL: str(minilm_dir()), "tiny": tiny_llama_dir}
    server = factory(models, aliases={MODEL: (ALIAS,)}, preload=(MODEL,))
    yield server
    server.stop()


def _reference(node: LiveServer, texts: list[str]) -> torch.Tensor:
    embedder = node.engine(MODEL).embedder
    return embedder.embed(embedder.tokenize(texts))


def _post(node: LiveServer, body: dict, path: str = "/v1/embeddings") -> httpx.Response:
    return httpx.post(node.url + path, json=body, timeout=60)


def test_openai_sdk_base64_and_float_agree_with_the_engine(node: LiveServer) -> None:
    import openai

    client = openai.OpenAI(base_url=node.url + "/v1", api_key="unused")
    result = client.embeddings.create(model=ALIAS, input=TEXTS)  # the SDK asks for base64 by default
    got = torch.tensor([d.embedding for d in result.data])
    reference = _reference(node, TEXTS)
    torch.testing.assert_close(got, reference, atol=1e-6, rtol=0)
    tokens = node.engine(MODEL).embedder.tokenize(TEXTS)
    assert result.usage.prompt_tokens == sum(map(len, tokens)) and tokens[2].__len__() == 256
    floats = _post(node, {"model": MODEL, "input": TEXTS, "encoding_format": "float"}).json()
    assert [d["index"] for d in floats["data"]] == [0, 1, 2]
    torch.testing.assert_close(torch.tensor([d["embedding"] for d in floats["data"]]), got, atol=1e-7, rtol=0)
    raw = _post(node, {"model": MODEL, "input": TEXTS[0], "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(decoded, got[0].numpy(), atol=1e-6)  # alone, not in a batch of 3


def test_token_id_inputs_and_dimensions(node: LiveServer) -> None:
    ids = node.engine(MODEL).embedder.tokenize(TEXTS[:2])
    text = _post(node, {"model": MODEL, "input": TEXTS[:2], "encoding_format": "float"}).json()
    one = _post(node, {"model": MODEL, "input": ids[0], "encoding_format": "float"}).json()
    many = _post(node, {"model": MODEL, "input": ids, "encoding_format": "float"}).json()
    assert one["data"][0]["embedding"] == pytest.approx(text["data"][0]["embedding"], abs=1e-6)
    assert many["data"][1]["embedding"] == pytest.approx(text["data"][1]["embedding"], abs=1e-6)
    assert many["usage"]["prompt_tokens"] == len(ids[0]) + len(ids[1])
    short = _post(
        node, {"model": MODEL, "input": TEXTS[0], "dimensions": 64, "encoding_format": "float"}
    ).json()
    vector = torch.tensor(short["data"][0]["embedding"])
    full = torch.tensor(text["data"][0]["embedding"])
    assert vector.shape == (64,) and vector.norm().item() == pytest.approx(1.0, abs=1e-5)
    torch.testing.assert_close(vector, torch.nn.functional.normalize(full[:64], dim=0), atol=1e-6, rtol=0)


def test_langchain_openai_embeddings(node: LiveServer) -> None:
    from langchain_openai import OpenAIEmbeddings

    # check_embedding_ctx_length=False: otherwise LangChain tokenizes with tiktoken (OpenAI's vocabulary,
    # fetched from the network) and sends those token ids, which mean nothing to a BERT vocabulary.
    lc = OpenAIEmbeddings(
        model=MODEL, base_url=node.url + "/v1", api_key="unused", check_embedding_ctx_length=False
    )
    reference = _reference(node, TEXTS)
    torch.testing.assert_close(torch.tensor(lc.embed_documents(TEXTS)), reference, atol=1e-6, rtol=0)
    torch.testing.assert_close(torch.tensor(lc.embed_query(TEXTS[1])), reference[1], atol=1e-6, rtol=0)


def test_workers_ai_text_embeddings(node: LiveServer) -> None:
    path = f"/accounts/acct/ai/run/{ALIAS}"
    many = _post(node, {"text": TEXTS}, path).json()
    assert many["success"] is True and many["result"]["shape"] == [3, 384]
    torch.testing.assert_close(
        torch.tensor(many["result"]["data"]), _reference(node, TEXTS), atol=1e-6, rtol=0
    )
    one = _post(node, {"text": TEXTS[0]}, path).json()
    assert one["result"]["shape"] == [1, 384]
    bad = _post(node, {"prompt": "hi"}, path)
    assert bad.status_code == 400 and "send `text`" in bad.json()["errors"][0]["message"]
    empty = _post(node, {"text": []}, path)
    assert empty.status_code == 400 and empty.json()["success"] is False


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        ({"input": []}, 400, "empty list"),
        ({"input": ""}, 400, "empty string"),
        ({"input": ["ok", ""]}, 400, "input[1]"),
        ({"input": ["a"] * 100_000}, 400, "limit of 2048 inputs"),
        ({"input": [[101] * 300]}, 400, "maximum input length is 256"),
        ({"input": [30522]}, 400, "outside the vocabulary"),
        ({"input": "x", "dimensions": 385}, 400, "above this model's 384"),
        ({"input": "x", "dimensions": 0}, 400, "dimensions"),
        ({"input": "x", "encoding_format": "int8"}, 400, "encoding_format"),
        ({"input": 5}, 400, "input"),
        ({"input": "x", "model": "tiny"}, 400, "not an embedding model"),
        ({"input": "x", "model": "nope"}, 404, "does not exist"),
    ],
)
def test_bad_inputs_get_clear_4xx(node: LiveServer, body: dict, status: int, needle: str) -> None:
    response = _post(node, {"model": MODEL, **body})
    assert response.status_code == status, response.text
    assert needle in response.json()["error"]["message"]


def test_generation_routes_refuse_the_embedding_model_and_the_server_stays_up(node: LiveServer) -> None:
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    response = _post(node, chat, "/v1/chat/completions")
    assert response.status_code == 400 and "use /v1/embeddings" in response.json()["error"]["message"]
    assert _post(node, {"model": MODEL, "input": "still up"}).status_code == 200
    assert node.engine(MODEL).stats().num_waiting == 0


def test_usage_is_metered_and_metrics_count_batches(node: LiveServer) -> None:
    before = httpx.get(node.url + "/v1/usage").json()["data"]
    tokens = _post(node, {"model": MODEL, "input": TEXTS[:2]}).json()["usage"]["prompt_tokens"]
    rows = {r["model"]: r for r in httpx.get(node.url + "/v1/usage").json()["data"]}
    old = {r["model"]: r for r in before}.get(
        MODEL, {"input_tokens": 0, "output_tokens": 0, "cost_units": 0.0}
    )
    assert rows[MODEL]["input_tokens"] - old["input_tokens"] == tokens
    assert rows[MODEL]["output_tokens"] == old["output_tokens"] == 0
    assert rows[MODEL]["cost_units"] - old["cost_units"] == pytest.approx(
        tokens * 100.0 / 1e6
    )  # default price
    metrics = httpx.get(node.url + "/metrics").text
    assert f'edgeinfer:embedding_batch_size_count{{model="{MODEL}"}}' in metrics
    assert f'edgeinfer:prompt_tokens_total{{model="{MODEL}"}}' in metrics


def test_embedding_model_shares_the_pool_budget(node_factory: NodeFactory, tiny_llama_dir: str) -> None:
    from helpers.node_engine import TEST_ENGINE

    from edgeinfer.pool.loader import EngineLoader
    from edgeinfer.pool.spec import LOCAL, MemberSpec

    minilm = str(minilm_dir())
    loader = EngineLoader(TEST_ENGINE)
    sizes = [loader.estimate_bytes(MemberSpec("m", LOCAL, target)) for target in (minilm, tiny_llama_dir)]
    # Room for the embedding model plus half the tiny one: loading either evicts the other.
    server = node_factory({MODEL: minilm, "tiny": tiny_llama_dir}, budget=sizes[0] + sizes[1] // 2)
    completion = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
    assert _post(server, completion, "/v1/completions").status_code == 200
    assert _post(server, {"model": MODEL, "input": "evicts tiny"}).status_code == 200
    assert set(server.service.pool.residents()) == {MODEL}
    assert 'edgeinfer:model_evictions_total{model="tiny"} 1.0' in httpx.get(server.url + "/metrics").text
    assert _post(server, completion, "/v1/completions").status_code == 200


def test_tenant_keys_and_token_limits_apply(node_factory: NodeFactory, make_tenant) -> None:
    tenants = [make_tenant("small", "key-small", tokens_per_minute=20)]
    server = node_factory({MODEL: str(minilm_dir())}, tenants=tenants)
    assert _post(server, {"model": MODEL, "input": "no key"}).status_code == 401
    headers = {"authorization": "Bearer key-small"}
    ok = httpx.post(server.url + "/v1/embeddings", json={"model": MODEL, "input": "short"}, headers=headers)
    assert ok.status_code == 200
    big = httpx.post(server.url + "/v1/embeddings", json={"model": MODEL, "input": TEXTS[2]}, headers=headers)
    assert big.status_code == 400 and "tokens" in big.json()["error"]["message"]

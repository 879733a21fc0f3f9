"""Every pooling mode on a tiny random BERT, against sentence-transformers loading the same directory."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import BertConfig, BertModel

from edgeinfer.engine.embedding.config import EmbeddingConfig
from edgeinfer.engine.embedding.embedder import Embedder
from edgeinfer.engine.embedding.sentence_config import read_sentence_config
from edgeinfer.engine.model.loader import CheckpointError

_FLAGS = {
    "mean": "pooling_mode_mean_tokens",
    "cls": "pooling_mode_cls_token",
    "max": "pooling_mode_max_tokens",
}
_FLAGS["lasttoken"] = "pooling_mode_lasttoken"
TEXTS = ["short", "a somewhat longer sentence with more words in it", "x " * 100, "Ünïcödé 🙂 漢字"]


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory: pytest.TempPathFactory, minilm: Path) -> Path:
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=30522,
        hidden_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=96,
        max_position_embeddings=64,
    )
    path = tmp_path_factory.mktemp("tiny-bert")
    BertModel(config).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(minilm / name, path / name)
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 40}))
    return path


def _sentence_dir(path: Path, mode: str, normalize: bool) -> None:
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append(
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}
        )
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir(exist_ok=True)
    flags = {flag: name == mode for name, flag in _FLAGS.items()}
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 48, **flags}))


@pytest.mark.parametrize(
    ("mode", "normalize"), [("cls", True), ("max", False), ("lasttoken", True), ("mean", False)]
)
def test_pooling_matches_sentence_transformers(tiny_bert: Path, mode: str, normalize: bool) -> None:
    from sentence_transformers import SentenceTransformer

    _sentence_dir(tiny_bert, mode, normalize)
    embedder = Embedder(EmbeddingConfig(model=str(tiny_bert), dtype="float32"))
    assert (embedder.sentence.pooling, embedder.sentence.normalize) == (mode, normalize)
    ours = embedder.embed(embedder.tokenize(TEXTS))
    reference = torch.tensor(SentenceTransformer(str(tiny_bert), device="cpu").encode(TEXTS))
    torch.testing.assert_close(ours, reference, atol=2e-5, rtol=1e-4)
    assert F.cosine_similarity(ours, reference).min() > 0.9999


def test_plain_hf_directory_means_without_normalising(tiny_bert: Path, tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    shutil.copytree(
        tiny_bert, plain, ignore=shutil.ignore_patterns("modules.json", "1_Pooling", "sentence_*")
    )
    config = json.loads((plain / "config.json").read_text())
    sentence = read_sentence_config(plain, config)
    assert (sentence.pooling, sentence.normalize, sentence.max_seq_length) == ("mean", False, 64)


def test_named_pooling_mode_and_refusals(tiny_bert: Path) -> None:
    config = json.loads((tiny_bert / "config.json").read_text())
    _sentence_dir(tiny_bert, "cls", False)
    (tiny_bert / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode": "lasttoken"}))
    assert read_sentence_config(tiny_bert, config).pooling == "lasttoken"
    (tiny_bert / "1_Pooling" / "config.json").write_text(
        json.dumps({"pooling_mode_weightedmean_tokens": True})
    )
    with pytest.raises(CheckpointError, match="unsupported"):
        read_sentence_config(tiny_bert, config)
    modules = json.loads((tiny_bert / "modules.json").read_text())
    modules.append({"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"})
    (tiny_bert / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(CheckpointError, match="Dense"):
        read_sentence_config(tiny_bert, config)

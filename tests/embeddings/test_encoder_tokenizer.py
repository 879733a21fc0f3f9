"""The encoder tokenizer read through `tokenizers` alone gives transformers' ids; a config it cannot honour
falls back to transformers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers.embeddings import varied_texts

from edgeinfer.engine.embedding.encoder_tokenizer import load_encoder_tokenizer

EXTRA = [
    "",
    "tab\there",
    "zero\u200bwidth",
    "café naïve façade",
    "日本語のテキスト",
    "A" * 2000,
    "[CLS] [SEP]",
]


def _transformers_ids(directory: Path, texts: list[str], max_length: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(directory))
    return [list(ids) for ids in hf(texts, truncation=True, max_length=max_length)["input_ids"]]


@pytest.mark.parametrize("max_length", [256, 16])
def test_direct_read_matches_transformers(minilm: Path, max_length: int) -> None:
    texts = varied_texts() + EXTRA
    tokenizer = load_encoder_tokenizer(minilm, max_length)
    assert tokenizer.direct
    ours = tokenizer.tokenize(texts)
    assert ours == _transformers_ids(minilm, texts, max_length)
    assert max(map(len, ours)) == max_length


def test_a_config_the_file_disagrees_with_goes_through_transformers(minilm: Path, tmp_path: Path) -> None:
    cased = tmp_path / "cased"
    shutil.copytree(minilm, cased)
    config_path = cased / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["do_lower_case"] = False  # transformers rewrites the lowercasing normalizer for this
    config_path.write_text(json.dumps(config))

    texts = ["Hello World", "UPPER CASE SHOUTING TEXT"]
    tokenizer = load_encoder_tokenizer(cased, 256)
    assert not tokenizer.direct
    ours = tokenizer.tokenize(texts)
    assert ours == _transformers_ids(cased, texts, 256)
    assert ours != load_encoder_tokenizer(minilm, 256).tokenize(texts)


def test_no_texts_no_ids(minilm: Path) -> None:
    assert load_encoder_tokenizer(minilm, 256).tokenize([]) == []

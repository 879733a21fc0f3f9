"""An encoder's tokenizer: texts in, token ids with the special tokens, truncated as sentence-transformers
truncates.

A BERT-style `tokenizer.json` (WordPiece with BertNormalizer, the usual sentence-transformers export) is read
through `tokenizers` alone: importing transformers for `AutoTokenizer` holds the interpreter for a large share
of a cached server start, on the event loop's thread. Transformers applies the config's casing and accent
settings by rewriting the normalizer, so a file whose normalizer disagrees with its config, or any other kind
of tokenizer, is loaded through transformers instead (tests/embeddings/test_encoder_tokenizer.py compares
both).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as RustTokenizer

_BERT_CLASSES = frozenset({"BertTokenizer", "BertTokenizerFast"})
# tokenizer_config.json key -> (BertNormalizer field, transformers' default for the key)
_NORMALIZER_KEYS = {
    "do_lower_case": ("lowercase", True),
    "strip_accents": ("strip_accents", None),
    "tokenize_chinese_chars": ("handle_chinese_chars", True),
}
_SIDES = ("truncation_side", "padding_side")


class EncoderTokenizer:
    """`tokenize(texts)`: one list of ids per text, at most `max_length` ids each, specials included."""

    def __init__(self, encode: Callable[[list[str]], list[list[int]]], direct: bool) -> None:
        self._encode = encode
        self.direct = direct  # read through `tokenizers` alone (False: through transformers)

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        return self._encode(list(texts)) if texts else []


def load_encoder_tokenizer(directory: Path, max_length: int) -> EncoderTokenizer:
    backend = _read_direct(directory)
    if backend is None:
        return _through_transformers(directory, max_length)
    backend.no_padding()
    backend.enable_truncation(max_length)
    return EncoderTokenizer(lambda texts: [e.ids for e in backend.encode_batch(texts)], direct=True)


def _read_direct(directory: Path) -> RustTokenizer | None:
    """The directory's `tokenizers` file when transformers would use it unchanged; None otherwise."""
    json_path = directory / "tokenizer.json"
    config_path = directory / "tokenizer_config.json"
    if not json_path.is_file() or not config_path.is_file():
        return None
    config: dict[str, Any] = json.loads(config_path.read_text())
    if config.get("tokenizer_class") not in _BERT_CLASSES:
        return None
    if any(config.get(side, "right") != "right" for side in _SIDES):
        return None
    backend = RustTokenizer.from_file(str(json_path))
    normalizer = json.loads(backend.normalizer.__getstate__()) if backend.normalizer else {}
    if normalizer.get("type") != "BertNormalizer":
        return None
    for key, (field, default) in _NORMALIZER_KEYS.items():
        if normalizer.get(field) != config.get(key, default):
            return None
    return backend


def _through_transformers(directory: Path, max_length: int) -> EncoderTokenizer:
    from transformers import AutoTokenizer  # only here: its import is the cost the direct path avoids

    hf = AutoTokenizer.from_pretrained(str(directory))

    def encode(texts: list[str]) -> list[list[int]]:
        return [list(ids) for ids in hf(texts, truncation=True, max_length=max_length)["input_ids"]]

    return EncoderTokenizer(encode, direct=False)

"""A saved fast tokenizer read through `tokenizers` alone, without transformers.

The tokenizer we save from a GGUF's metadata is a whole `tokenizers` serialization (normalizer, pre-tokenizer,
post-processor adding BOS, decoder, added tokens) plus a `tokenizer_config.json` naming the special tokens.
Serving only needs that much, and importing transformers is a large share of a cached start, so
`DirectTokenizer` offers the part of `PreTrainedTokenizerFast`'s interface the engine uses over the
`tokenizers.Tokenizer` itself. A config with any setting beyond the special tokens' names (say
`add_bos_token`, which transformers applies by rewriting the post-processor) is not read here:
`read_direct` returns None and the caller loads it through transformers.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as RustTokenizer

# in transformers' order of special-token attributes (`all_special_ids` lists them so)
SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# settings that change nothing the engine does with the tokenizer
_INERT_KEYS = frozenset({"backend", "is_local", "local_files_only", "model_max_length", "tokenizer_class"})


class SavedTokenizer(ABC):
    """What our readers of a saved tokenizer share: the special tokens of its config (`bos_token`,
    `bos_token_id`, ... as transformers names them), its chat template, and the tokenizer.json it came with
    (for llguidance). Subclasses look tokens up (`convert_tokens_to_ids`)."""

    def __init__(self, specials: dict[str, str], json_path: Path) -> None:
        self.special_tokens_map = dict(specials)
        self.chat_template: str | None = None
        self._json_path = json_path
        for name in SPECIAL_NAMES:
            token = specials.get(name)
            setattr(self, name, token)
            setattr(self, f"{name}_id", self.convert_tokens_to_ids(token) if token is not None else None)

    @abstractmethod
    def convert_tokens_to_ids(self, tokens: Any) -> Any: ...

    @property
    def all_special_ids(self) -> list[int]:
        ids = (getattr(self, f"{name}_id") for name in SPECIAL_NAMES)
        return list(dict.fromkeys(i for i in ids if i is not None))

    def serialized(self) -> str:
        """The tokenizer's `tokenizers` JSON as saved (without padding or truncation)."""
        return self._json_path.read_text(encoding="utf-8")


class DirectTokenizer(SavedTokenizer):
    """`tokenizers.Tokenizer` with the special tokens of its config, shaped like HF's fast tokenizer."""

    def __init__(self, backend: RustTokenizer, specials: dict[str, str], json_path: Path) -> None:
        self.backend_tokenizer = backend
        super().__init__(specials, json_path)

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(
        self, ids: list[int], skip_special_tokens: bool = False, clean_up_tokenization_spaces: bool = False
    ) -> str:
        if clean_up_tokenization_spaces:
            raise ValueError("DirectTokenizer does not clean up tokenization spaces")
        return self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: int | list[int]) -> str | list[str | None] | None:
        """One piece, or a list of them for a list of ids (as transformers answers)."""
        if isinstance(ids, list):
            return [self.backend_tokenizer.id_to_token(i) for i in ids]
        return self.backend_tokenizer.id_to_token(ids)

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | list[int | None] | None:
        """None for a token the vocabulary lacks (transformers would answer with the unknown id)."""
        if isinstance(tokens, list):
            return [self.backend_tokenizer.token_to_id(t) for t in tokens]
        return self.backend_tokenizer.token_to_id(tokens)


def read_specials(directory: Path) -> dict[str, str] | None:
    """The special tokens named in `directory`'s tokenizer_config.json; None when the config has settings
    only transformers applies."""
    config = json.loads((directory / "tokenizer_config.json").read_text())
    specials = {k: v for k, v in config.items() if k in SPECIAL_NAMES and v is not None}
    others = set(config) - set(SPECIAL_NAMES) - _INERT_KEYS
    if others or not all(isinstance(v, str) for v in specials.values()):
        return None
    return specials


def read_chat_template(directory: Path) -> str | None:
    template = directory / "chat_template.jinja"
    return template.read_text() if template.is_file() else None


def read_direct(directory: Path, specials: dict[str, str]) -> DirectTokenizer | None:
    """The tokenizer saved in `directory`, with the `specials` of its config; None when it pads or
    truncates."""
    json_path = directory / "tokenizer.json"
    backend = RustTokenizer.from_file(str(json_path))
    if backend.padding is not None or backend.truncation is not None:
        return None
    return DirectTokenizer(backend, specials, json_path)


def serialized_tokenizer(hf: Any) -> str:
    """The `tokenizers` JSON of a fast tokenizer (ours or HF's) without padding or truncation, as
    llguidance reads it (what `llguidance.hf` builds, without importing transformers here)."""
    if isinstance(hf, SavedTokenizer):
        return hf.serialized()
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None:
        raise ValueError("only fast tokenizers are supported")
    text = backend.to_str()
    if backend.padding is None and backend.truncation is None:
        return text
    data = json.loads(text)
    data["padding"] = data["truncation"] = None
    return json.dumps(data)

"""A SentencePiece-vocabulary GGUF's tokenizer, read quickly by `sentencepiece`.

`tokenizers` is slow to parse the saved tokenizer.json of a large vocabulary such as Gemma 3's, in one GIL
hold (its BPE merges most of it): most of a cached start, and a stall for every running stream while a
pool brings up another model. A GGUF whose vocabulary is SentencePiece's (`tokenizer.ggml.model = llama`)
carries what SentencePiece's own model file holds: each piece with its score and type (without a dummy
prefix: tokenizer.py writes it only where `tokenizer.ggml.add_space_prefix` is false). We write those as
SentencePiece's model proto (`spm.model`) beside the saved tokenizer.json, with the tokenizer's added tokens
(`spm_added.json`), and read them with `sentencepiece`, which loads them many times faster.

It encodes as transformers' tokenizer of the same GGUF does: added tokens (control tokens such as
`<start_of_turn>`, and the non-special ones such as newline runs) are matched in the raw text first, leftmost
and longest, and the text between them is encoded by SentencePiece's BPE (merges by piece priority, byte
fallback); BOS goes first with `add_special_tokens`. Decoding joins SentencePiece's decode of the pieces
between added tokens, the added tokens' text, and runs of byte pieces decoded as transformers' ByteFallback
does. When the files are written the result is checked against the transformers tokenizer on a sample
(`agrees`); one that disagrees is not kept, and `tokenizers` reads tokenizer.json instead.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import sentencepiece

from edgeinfer.engine.direct_tokenizer import SavedTokenizer

MODEL_FILE = "spm.model"
ADDED_FILE = "spm_added.json"
SPACE = "\u2581"
# SentencePiece's piece types (sentencepiece_model.proto), as GGUF's token_type numbers them too.
_UNKNOWN = 2
# Texts the written tokenizer must encode and decode as transformers' does before it is kept.
SAMPLE = (
    "Hello world, the capital of France is Paris.",
    "  two leading spaces,  doubled   inside, trailing  ",
    "line\nbreaks\n\n\nand\ttabs\t\t",
    "naïve café 漢字かな 🙂🚀 👨‍👩‍👧 𓀀 ЖЖ \u200b\u00a0",
    "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n",
    "<bos>text <eos> <unk> <pad><mask>",
    "<table><tr><td>a</td></tr></table> [multimodal] <unused5>",
    "",
)


def write_spm(directory: Path, metadata: dict[str, Any], added: Sequence[dict[str, Any]]) -> None:
    """`spm.model` from a GGUF's tokenizer metadata and `spm_added.json` from the tokenizer's added tokens
    (transformers' `added_tokens` entries: id, content, special). As transformers' GGUF reader does, runs
    of spaces (stored as real spaces) are spelt with `▁`, and Gemma's pieces merge in the order the file
    lists them, not by their scores."""
    tokens = [SPACE * len(t) if " " in t and not t.strip() else t for t in metadata["tokenizer.ggml.tokens"]]
    gemma = str(metadata.get("general.architecture", "")).startswith("gemma")
    scores = [-float(i) for i in range(len(tokens))] if gemma else metadata["tokenizer.ggml.scores"]
    types: list[int] = list(metadata["tokenizer.ggml.token_type"])
    unk = metadata.get("tokenizer.ggml.unknown_token_id")
    if unk is not None:
        types[unk] = _UNKNOWN
    body = bytearray()
    for piece, score, kind in zip(tokens, scores, types, strict=True):
        body += _bytes(1, _bytes(1, piece.encode()) + _float(2, score) + _int(3, kind))
    body += _bytes(2, _trainer_spec(metadata, len(tokens)))
    # no normalisation but spaces escaped as ▁, no dummy prefix, spaces kept as they are
    body += _bytes(3, _bytes(1, b"identity") + _int(3, 0) + _int(4, 0) + _int(5, 1))
    (directory / MODEL_FILE).write_bytes(bytes(body))
    entries = [[int(a["id"]), a["content"], bool(a["special"])] for a in added]
    (directory / ADDED_FILE).write_text(json.dumps(entries, ensure_ascii=False))


def _trainer_spec(metadata: dict[str, Any], size: int) -> bytes:
    spec = _int(3, 2) + _int(4, size) + _int(35, 1)  # BPE, the vocabulary's size, byte fallback
    for field, key in ((40, "unknown"), (41, "bos"), (42, "eos"), (43, "padding")):
        value = metadata.get(f"tokenizer.ggml.{key}_token_id")
        spec += _int(field, -1 if value is None else int(value))
    return spec


# protobuf's wire format, as far as the model file needs it
def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # negative int32 values as ten-byte varints, as protobuf writes them
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        out.append(low | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _int(field: int, value: int) -> bytes:
    return _varint(field << 3) + _varint(value)


def _float(field: int, value: float) -> bytes:
    return _varint(field << 3 | 5) + struct.pack("<f", value)


def _bytes(field: int, value: bytes) -> bytes:
    """A length-delimited field: a string, or an embedded message's encoding."""
    return _varint(field << 3 | 2) + _varint(len(value)) + value


class AddedTokens:
    """The added tokens, found in raw text leftmost-longest (as transformers' AddedVocabulary does)."""

    def __init__(self, entries: Sequence[tuple[int, str, bool]]) -> None:
        self.ids = {content: token_id for token_id, content, _ in entries}
        self.text = {token_id: content for token_id, content, _ in entries}
        self.special = frozenset(token_id for token_id, _, special in entries if special)
        lengths: dict[str, set[int]] = {}
        for content in self.ids:
            lengths.setdefault(content[0], set()).add(len(content))
        self._lengths = {first: sorted(found, reverse=True) for first, found in lengths.items()}
        firsts = "".join(map(re.escape, self._lengths))
        self._starts = re.compile(f"[{firsts}]") if firsts else None

    def split(self, text: str) -> Iterator[str | int]:
        """`text` as the pieces between added tokens (str) and the added tokens' ids (int)."""
        done = at = 0
        while self._starts is not None and (found := self._starts.search(text, at)) is not None:
            start = found.start()
            token_id = self._longest_at(text, start)
            if token_id is None:
                at = start + 1
                continue
            if start > done:
                yield text[done:start]
            yield token_id
            done = at = start + len(self.text[token_id])
        if done < len(text):
            yield text[done:]

    def _longest_at(self, text: str, start: int) -> int | None:
        for length in self._lengths[text[start]]:
            token_id = self.ids.get(text[start : start + length])
            if token_id is not None:
                return token_id
        return None


def _flush_bytes(raw: bytearray, out: list[str]) -> None:
    """A run of byte pieces as its UTF-8 text, or one U+FFFD per byte where the run is not valid UTF-8 (as
    transformers' ByteFallback decoder writes it; the streaming detokenizer holds back text ending so)."""
    if raw:
        try:
            out.append(raw.decode("utf-8"))
        except UnicodeDecodeError:
            out.append("\ufffd" * len(raw))
        raw.clear()


class SpmTokenizer(SavedTokenizer):
    """SentencePiece with the added tokens of its config, shaped like HF's fast tokenizer (as
    `DirectTokenizer`, which reads the same directory's tokenizer.json)."""

    def __init__(self, directory: Path, specials: dict[str, str]) -> None:
        self.sp = sentencepiece.SentencePieceProcessor(model_file=str(directory / MODEL_FILE))
        entries = json.loads((directory / ADDED_FILE).read_text(encoding="utf-8"))
        self.added = AddedTokens([(int(i), str(c), bool(s)) for i, c, s in entries])
        byte_ids = (self._id(f"<0x{b:02X}>") for b in range(256))
        self._byte_of = {token_id: b for b, token_id in enumerate(byte_ids) if token_id is not None}
        super().__init__(specials, directory / "tokenizer.json")

    def __len__(self) -> int:
        """The pieces and the added tokens beyond them (transformers may add a family's specials)."""
        return max(self.sp.get_piece_size(), max(self.added.text, default=-1) + 1)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        parts = list(self.added.split(text))
        pieces = [p for p in parts if isinstance(p, str)]
        encoded = iter(self.sp.encode(pieces)) if pieces else iter(())
        ids = [self.bos_token_id] if add_special_tokens and self.bos_token_id is not None else []
        for part in parts:
            if isinstance(part, str):
                ids.extend(next(encoded))
            else:
                ids.append(part)
        return ids

    def decode(
        self, ids: list[int], skip_special_tokens: bool = False, clean_up_tokenization_spaces: bool = False
    ) -> str:
        if clean_up_tokenization_spaces:
            raise ValueError("SpmTokenizer does not clean up tokenization spaces")
        if skip_special_tokens:  # gone before decoding: the runs either side of one join up
            ids = [token_id for token_id in ids if token_id not in self.added.special]
        out: list[str] = []
        pieces: list[int] = []  # a run of vocabulary pieces, decoded by SentencePiece
        raw = bytearray()  # a run of byte pieces
        for token_id in ids:
            byte = self._byte_of.get(token_id)
            if byte is not None:
                self._flush_pieces(pieces, out)
                raw.append(byte)
                continue
            _flush_bytes(raw, out)
            text = self.added.text.get(token_id)
            if text is None:
                pieces.append(token_id)
                continue
            self._flush_pieces(pieces, out)
            out.append(text)
        self._flush_pieces(pieces, out)
        _flush_bytes(raw, out)
        return "".join(out)

    def _flush_pieces(self, pieces: list[int], out: list[str]) -> None:
        if pieces:
            out.append(self.sp.decode(pieces))
            pieces.clear()

    def convert_ids_to_tokens(self, ids: int | list[int]) -> str | list[str | None] | None:
        """One piece, or a list of them for a list of ids (as transformers answers)."""
        if isinstance(ids, list):
            return [self._piece(i) for i in ids]
        return self._piece(ids)

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | list[int | None] | None:
        """None for a token the vocabulary lacks (transformers would answer with the unknown id)."""
        if isinstance(tokens, list):
            return [self._id(t) for t in tokens]
        return self._id(tokens)

    def _piece(self, token_id: int) -> str | None:
        if not 0 <= token_id < len(self):
            return None
        return self.added.text.get(token_id) or self.sp.id_to_piece(token_id)

    def _id(self, token: str) -> int | None:
        token_id = self.added.ids.get(token)
        if token_id is not None:
            return token_id
        token_id = self.sp.piece_to_id(token)
        found = 0 <= token_id < self.sp.get_piece_size() and self.sp.id_to_piece(token_id) == token
        return token_id if found else None


def read_spm(directory: Path, specials: dict[str, str]) -> SpmTokenizer | None:
    """The SentencePiece form saved in `directory`, or None where there is none."""
    if not (directory / MODEL_FILE).is_file() or not (directory / ADDED_FILE).is_file():
        return None
    return SpmTokenizer(directory, specials)


def agrees(ours: SpmTokenizer, reference: Any, texts: Sequence[str] = SAMPLE) -> bool:
    """Whether `ours` encodes and decodes `texts` (and every added token) as `reference` does."""
    for text in (*texts, "".join(ours.added.ids)):
        for special in (True, False):
            ids = reference.encode(text, add_special_tokens=special)
            if ours.encode(text, add_special_tokens=special) != ids:
                return False
            for skip in (True, False):
                theirs = reference.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
                if ours.decode(ids, skip_special_tokens=skip) != theirs:
                    return False
    return True

"""Streaming detokenization: deltas add up to a full decode, never split a character, bounded work."""

from __future__ import annotations

import functools
import random
from collections.abc import Sequence

import pytest
from transformers.convert_slow_tokenizer import bytes_to_unicode

from edgeinfer.engine.detokenizer import IncrementalDetokenizer
from edgeinfer.engine.tokenizer import Tokenizer

TEXT = "Streaming 漢字かな and emoji 🙂🚀👩‍👩‍👧 — naïve café. 𓀀 (byte fallback) done.\n  indented"
TOKENIZERS = ["bpe_tokenizer", "spm_tokenizer", pytest.param("gemma_tokenizer", marks=pytest.mark.gemma)]


def stream(detok: IncrementalDetokenizer, ids: Sequence[int], rng: random.Random | None = None) -> list[str]:
    """Feed `ids` one at a time (or in random-sized groups), then flush; return every delta."""
    deltas, i = [], 0
    while i < len(ids):
        step = rng.randint(1, 4) if rng else 1
        deltas.append(detok.add(ids[i : i + step]))
        i += step
    deltas.append(detok.flush())
    return deltas


def continuation(tokenizer: Tokenizer, prompt: list[int], ids: list[int]) -> str:
    """What `ids` add to the full decode of `prompt + ids` (the prompt's text is never rewritten)."""
    full, before = tokenizer.decode(prompt + ids), tokenizer.decode(prompt)
    assert full.startswith(before)
    return full[len(before) :]


@functools.cache
def byte_tokens(tokenizer: Tokenizer) -> dict[str, int]:
    """The byte-fallback tokens (`<0xE4>` -> id) of a SentencePiece vocabulary; none in byte-level BPE."""
    pieces = [f"<0x{b:02X}>" for b in range(256)]
    ids = tokenizer.hf.convert_tokens_to_ids(pieces)
    found = zip(pieces, ids, strict=True)
    return {piece: i for piece, i in found if i is not None and tokenizer.id_to_piece(i) == piece}


def random_ids(tokenizer: Tokenizer, rng: random.Random, length: int) -> list[int]:
    """Random ids, with byte-fallback tokens only as whole, valid UTF-8 characters (as a model emits them).

    A lone invalid byte would make a full decode rewrite characters before it (tokenizers' ByteFallback turns
    a whole run of byte tokens into U+FFFD when any of it is invalid), which no stream can anticipate.
    """
    byte_ids = byte_tokens(tokenizer)
    ids: list[int] = []
    while len(ids) < length:
        if byte_ids and rng.random() < 0.1:
            char = chr(rng.choice([0xE9, 0x6F22, 0x1F642, 0x13000, 0x10FFFD]))
            ids += [byte_ids[f"<0x{b:02X}>"] for b in char.encode("utf-8")]
        else:
            token = rng.randrange(tokenizer.vocab_size)
            if token not in byte_ids.values():
                ids.append(token)
    return ids


@pytest.mark.parametrize("name", TOKENIZERS)
def test_real_text_streams_exactly(request: pytest.FixtureRequest, name: str) -> None:
    tokenizer: Tokenizer = request.getfixturevalue(name)
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    deltas = stream(IncrementalDetokenizer(tokenizer), ids)
    assert "".join(deltas) == tokenizer.decode(ids) == TEXT
    assert not any("\ufffd" in delta for delta in deltas)  # no character was ever emitted half-done
    prompt = tokenizer.encode("Prompt:")
    with_prompt = IncrementalDetokenizer(tokenizer, prompt)
    # After a prompt, SentencePiece shows the text's leading ▁ as a space, as a full decode does.
    assert "".join(stream(with_prompt, ids)) == continuation(tokenizer, prompt, ids)


@pytest.mark.parametrize("name", TOKENIZERS)
def test_random_sequences_match_full_decode(request: pytest.FixtureRequest, name: str) -> None:
    tokenizer: Tokenizer = request.getfixturevalue(name)
    rng = random.Random(1234)
    for _ in range(20):
        prompt, ids = random_ids(tokenizer, rng, 8), random_ids(tokenizer, rng, 60)
        detok = IncrementalDetokenizer(tokenizer, prompt)
        text = "".join(stream(detok, ids, rng))
        assert text == detok.text
        assert text == continuation(tokenizer, prompt, ids)
        assert "".join(stream(IncrementalDetokenizer(tokenizer), ids)) == tokenizer.decode(ids)


def test_invalid_bytes_are_held_then_released(bpe_tokenizer: Tokenizer) -> None:
    # Byte-level BPE decodes lossily and left to right, so even invalid bytes stream exactly.
    vocab, spelling = bpe_tokenizer.hf.get_vocab(), bytes_to_unicode()
    lead, continuation = vocab[spelling[0xF0]], vocab[spelling[0x9F]]  # single-byte tokens
    detok = IncrementalDetokenizer(bpe_tokenizer)
    assert detok.add([lead]) == "" and detok.add([continuation]) == ""  # an unfinished 4-byte character
    hi = bpe_tokenizer.encode("hi", add_special_tokens=False)
    assert detok.add(hi) == "\ufffdhi"  # the next token proves it will never finish
    garbage = [continuation] * 40  # a run of bytes that never forms a character is not held forever
    deltas = stream(detok, garbage)
    assert "".join(deltas) == bpe_tokenizer.decode(garbage)
    assert sum(1 for delta in deltas if delta) >= 2


def test_special_tokens_are_skipped_unless_asked(spm_tokenizer: Tokenizer) -> None:
    ids = [*spm_tokenizer.encode("hello", add_special_tokens=False), 3, 2]  # <end_of_turn>, </s>
    assert "".join(stream(IncrementalDetokenizer(spm_tokenizer), ids)) == "hello"
    kept = IncrementalDetokenizer(spm_tokenizer, skip_special_tokens=False)
    assert "".join(stream(kept, ids)) == "hello<end_of_turn></s>"


class CountingDecoder:
    """Records how many ids each decode call is given."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer, self.sizes = tokenizer, []

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        self.sizes.append(len(ids))
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("name", ["bpe_tokenizer", "spm_tokenizer"])
def test_work_per_step_does_not_grow(request: pytest.FixtureRequest, name: str) -> None:
    tokenizer: Tokenizer = request.getfixturevalue(name)
    prompt, ids = tokenizer.encode(TEXT * 5), tokenizer.encode(TEXT * 30, add_special_tokens=False)
    counter = CountingDecoder(tokenizer)
    text = "".join(stream(IncrementalDetokenizer(counter, prompt), ids))
    assert text == continuation(tokenizer, prompt, ids)
    assert len(ids) > 1000 and max(counter.sizes) <= 12  # a character's bytes plus a little context

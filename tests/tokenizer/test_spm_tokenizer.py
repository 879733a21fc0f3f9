"""The SentencePiece read of a GGUF's saved tokenizer (engine/spm_tokenizer.py) against transformers' own
tokenizer of the same files: added tokens found leftmost-longest, and the real Gemma 3 vocabulary encoding
and decoding alike over a corpus, random text and random token ids."""

from __future__ import annotations

import random
from pathlib import Path

import gensim
import pytest

from edgeinfer.engine.model.loader import open_checkpoint
from edgeinfer.engine.spm_tokenizer import AddedTokens, SpmTokenizer
from edgeinfer.engine.tokenizer import Tokenizer, _load_pretrained, _load_saved


def test_added_tokens_are_found_leftmost_and_longest():
    added = AddedTokens([(10, "<a>", True), (11, "<ab>", True), (12, "\n", False), (13, "\n\n", False)])
    assert list(added.split("x<ab>y<a>\n\n\nz<")) == ["x", 11, "y", 10, 13, 12, "z<"]
    assert list(added.split("<a><ab><")) == [10, 11, "<"]
    assert list(added.split("")) == [] and list(AddedTokens([]).split("plain")) == ["plain"]


def _texts(added: list[str]) -> list[str]:
    corpus = Path(gensim.__file__).parent / "test" / "test_data" / "lee_background.cor"
    texts = corpus.read_text(encoding="utf-8").splitlines()
    rng = random.Random(0)
    alphabet = "abc xyz  \t\n\n\nÄöü€😀日本語テキスト--__**##<>{}[]()1234567890.,;:!?'\"\\/é́ñ\u200b\u00a0𓀀"
    for _ in range(1500):
        texts.append("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 60))))
    for _ in range(300):  # added tokens inside text, and runs of them
        parts = [rng.choice([rng.choice(added), rng.choice(texts[:50])[:12], " ", "\n"]) for _ in range(8)]
        texts.append("".join(parts))
    return texts


@pytest.mark.gemma
def test_gemma_vocabulary_reads_as_transformers_does(gemma_tokenizer: Tokenizer):
    cache = open_checkpoint("gemma-3-270m").tokenizer_dir
    ours, theirs = _load_saved(cache), _load_pretrained(cache)
    assert isinstance(ours, SpmTokenizer) and len(ours) == len(theirs) == 262144
    for text in _texts(list(ours.added.ids)):
        for special in (True, False):
            assert ours.encode(text, add_special_tokens=special) == theirs.encode(
                text, add_special_tokens=special
            )
    rng = random.Random(1)
    byte_ids = ours.convert_tokens_to_ids([f"<0x{b:02X}>" for b in range(256)])
    assert None not in byte_ids
    pools = [range(len(ours)), byte_ids, sorted(ours.added.text)]  # any id, byte pieces, added tokens
    for _ in range(2000):
        ids = [rng.choice(rng.choice(pools)) for _ in range(rng.randint(1, 12))]
        for skip in (True, False):
            want = theirs.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
            assert ours.decode(ids, skip_special_tokens=skip) == want, ids
        assert ours.convert_ids_to_tokens(ids) == theirs.convert_ids_to_tokens(ids)
    pieces = theirs.convert_ids_to_tokens(rng.sample(range(len(ours)), 2000))
    assert ours.convert_tokens_to_ids(pieces) == theirs.convert_tokens_to_ids(pieces)
    assert ours.convert_tokens_to_ids("not a piece of the vocabulary") is None

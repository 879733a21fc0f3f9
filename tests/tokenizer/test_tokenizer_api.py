"""The Tokenizer API over a byte-level BPE checkpoint, a SentencePiece GGUF (built and cached) and Gemma 3."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizer_files import write_spm_gguf

from edgeinfer.engine.direct_tokenizer import DirectTokenizer
from edgeinfer.engine.model.loader import CheckpointError, open_checkpoint
from edgeinfer.engine.spm_tokenizer import SpmTokenizer
from edgeinfer.engine.tokenizer import Tokenizer

TEXTS = ["Hello world", "naïve café 漢字 🙂🚀", "  leading spaces", "line\nbreaks\tand tabs", ""]


def test_bpe_round_trip_and_special_ids(bpe_tokenizer: Tokenizer) -> None:
    for text in TEXTS:
        ids = bpe_tokenizer.encode(text)
        assert ids[0] == bpe_tokenizer.bos_token_id == 1
        assert bpe_tokenizer.decode(ids) == text
        assert bpe_tokenizer.encode(text, add_special_tokens=False) == ids[1:]
    assert bpe_tokenizer.decode([1, *bpe_tokenizer.encode("hi", False)], skip_special_tokens=False) == "<s>hi"
    # </s> from the tokenizer and config.json, <eot> (id 3) only from generation_config.json.
    assert bpe_tokenizer.eos_token_ids == frozenset({2, 3})
    assert bpe_tokenizer.pad_token_id == 0 and bpe_tokenizer.vocab_size == len(bpe_tokenizer.hf)


def test_no_double_bos(bpe_tokenizer: Tokenizer) -> None:
    ids = bpe_tokenizer.encode("<s>already has one")
    assert ids.count(1) == 1 and ids[0] == 1


def test_pieces_and_range_checks(bpe_tokenizer: Tokenizer) -> None:
    assert bpe_tokenizer.id_to_piece(1) == "<s>"
    assert bpe_tokenizer.id_to_piece(bpe_tokenizer.encode(" fox", False)[0]) == "Ġfox"
    with pytest.raises(ValueError, match="out of range"):
        bpe_tokenizer.decode([5, bpe_tokenizer.vocab_size])
    with pytest.raises(ValueError, match="out of range"):
        bpe_tokenizer.id_to_piece(-1)
    with pytest.raises(ValueError, match="must be a string"):
        bpe_tokenizer.encode(b"bytes")  # type: ignore[arg-type]


def test_sentencepiece_gguf_tokenizer(spm_tokenizer: Tokenizer) -> None:
    ids = spm_tokenizer.encode("hello world 漢")
    pieces = [spm_tokenizer.id_to_piece(i) for i in ids]
    assert pieces[:3] == ["<s>", "▁", "h"] and "<0xE6>" in pieces  # space marker and byte fallback
    assert spm_tokenizer.decode(ids) == "hello world 漢"
    assert spm_tokenizer.eos_token_ids == frozenset({2, 3})  # </s> and the <end_of_turn> control token


def test_gguf_tokenizer_is_cached_and_rebuilt_when_the_file_changes(tmp_path: Path) -> None:
    path = write_spm_gguf(tmp_path / "m.gguf")
    first = Tokenizer.from_checkpoint(open_checkpoint(path))
    cache = tmp_path / "m.gguf.tokenizer"
    assert (cache / "tokenizer.json").is_file()
    stamp = json.loads((cache / "edgeinfer_source.json").read_text())
    assert stamp["size"] == path.stat().st_size
    (cache / "tokenizer.json").write_text("{}")  # a cache that would break loading if it were read
    path.touch()  # ...but the GGUF changed since, so it is rebuilt instead
    again = Tokenizer.from_checkpoint(open_checkpoint(path))
    assert again.encode("the edge!") == first.encode("the edge!")
    cached = Tokenizer.from_checkpoint(open_checkpoint(path))  # now from the fresh cache
    assert cached.encode("the edge!") == first.encode("the edge!")
    assert cached.eos_token_ids == first.eos_token_ids


def _assert_reads_alike(cache: Path, texts: list[str], kind: type) -> None:
    """Cached starts read the tokenizer saved from GGUF metadata without transformers (`kind`: through
    SentencePiece or `tokenizers`); it must encode and decode as the class AutoTokenizer builds from the same
    directory."""
    from edgeinfer.engine.tokenizer import _load_pretrained, _load_saved

    fast, auto = _load_saved(cache), _load_pretrained(cache)
    assert isinstance(fast, kind)  # not transformers' class: the comparison means something
    for text in texts:
        for special in (True, False):
            assert fast.encode(text, add_special_tokens=special) == auto.encode(
                text, add_special_tokens=special
            )
        ids = auto.encode(text)
        for skip in (True, False):
            assert fast.decode(ids, skip_special_tokens=skip) == auto.decode(ids, skip_special_tokens=skip)
        assert fast.convert_ids_to_tokens(ids) == auto.convert_ids_to_tokens(ids)
    ours = (fast.bos_token_id, fast.eos_token_id, fast.pad_token_id, len(fast), fast.all_special_ids)
    assert ours == (auto.bos_token_id, auto.eos_token_id, auto.pad_token_id, len(auto), auto.all_special_ids)


@pytest.mark.parametrize("arch,kind", [("llama", DirectTokenizer), ("gemma3", SpmTokenizer)])
def test_saved_gguf_tokenizer_reads_as_autotokenizer_does(tmp_path: Path, arch, kind) -> None:
    # a vocabulary with a dummy space prefix (Llama 2's) keeps `tokenizers`; one without (Gemma's) is read
    # by SentencePiece
    path = write_spm_gguf(tmp_path / "m.gguf", arch)
    Tokenizer.from_checkpoint(open_checkpoint(path))
    texts = [*TEXTS, "<s>hi</s> <end_of_turn>x", "hello world 漢", "  the  model\n\n edge"]
    _assert_reads_alike(tmp_path / "m.gguf.tokenizer", texts, kind)


@pytest.mark.gemma
def test_saved_gemma_tokenizer_reads_as_gemma_tokenizer_does(gemma_tokenizer: Tokenizer) -> None:
    """Gemma's own class (GemmaTokenizer) against the SentencePiece read of the same saved files."""
    cache = open_checkpoint("gemma-3-270m").tokenizer_dir
    texts = [*TEXTS, "<start_of_turn>user\nHi<end_of_turn>\n", "𓀀 needs byte fallback", "a  b   c\n\n"]
    _assert_reads_alike(cache, texts, SpmTokenizer)


def test_a_sentencepiece_form_that_reads_otherwise_is_not_kept(tmp_path: Path, monkeypatch) -> None:
    from edgeinfer.engine import spm_tokenizer

    real = spm_tokenizer.SpmTokenizer.encode
    one_short = lambda self, text, **kwargs: real(self, text, **kwargs)[:-1]  # noqa: E731
    monkeypatch.setattr(spm_tokenizer.SpmTokenizer, "encode", one_short)
    path = write_spm_gguf(tmp_path / "m.gguf", "gemma3")
    Tokenizer.from_checkpoint(open_checkpoint(path))
    cache = tmp_path / "m.gguf.tokenizer"
    assert not (cache / spm_tokenizer.MODEL_FILE).exists()
    _assert_reads_alike(cache, TEXTS, DirectTokenizer)


def test_unloadable_tokenizer_is_a_checkpoint_error(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (tmp_path / "tokenizer.json").write_text("{not json")
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"})
    )
    (tmp_path / "model.safetensors").write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{}")
    with pytest.raises(CheckpointError, match="cannot load tokenizer"):
        Tokenizer.from_checkpoint(open_checkpoint(tmp_path))


@pytest.mark.gemma
def test_gemma_tokenizer(gemma_tokenizer: Tokenizer) -> None:
    assert gemma_tokenizer.vocab_size == 262144 and gemma_tokenizer.bos_token_id == 2
    assert gemma_tokenizer.eos_token_ids == frozenset({1, 106})  # <eos> and <end_of_turn>
    assert gemma_tokenizer.id_to_piece(106) == "<end_of_turn>"
    ids = gemma_tokenizer.encode("Hello world")
    assert ids == [2, 9259, 1902]  # <bos> Hello ▁world
    for text in TEXTS + ["𓀀 needs byte fallback"]:
        assert gemma_tokenizer.decode(gemma_tokenizer.encode(text)) == text
    pieces = [gemma_tokenizer.id_to_piece(i) for i in gemma_tokenizer.encode("𓀀", add_special_tokens=False)]
    assert pieces == ["<0xF0>", "<0x93>", "<0x80>", "<0x80>"]

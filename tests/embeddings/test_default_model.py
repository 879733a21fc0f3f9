"""The default embedding model's package: extracted once, re-extracted when damaged, refused when forged;
and `edgeinfer embed` on it."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from helpers.embeddings import minilm_dir

from edgeinfer.engine.model.loader import CheckpointError, open_checkpoint
from edgeinfer.engine.model.loader import default_embedding as de


def test_extracts_once_and_repairs_a_damaged_copy(tmp_path: Path) -> None:
    minilm_dir()  # skips without the package
    target = de.resolve_default_embedding_model(tmp_path)
    assert (target / "modules.json").is_file() and (target / "1_Pooling" / "config.json").is_file()
    marker = json.loads((tmp_path / "all-MiniLM-L6-v2.verified").read_text())
    assert marker["sha256"] == de.ZIP_SHA256
    config = target / "config.json"
    config.write_text("{}")
    assert de.resolve_default_embedding_model(tmp_path) == target
    assert json.loads(config.read_text())["architectures"] == ["BertModel"]  # re-extracted


def test_a_zip_with_another_hash_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    forged = tmp_path / "model.zip"
    with zipfile.ZipFile(forged, "w") as zf:
        zf.writestr("config.json", "{}")
    monkeypatch.setattr(de, "_package_zip", lambda: de._Archive(forged, None))
    with pytest.raises(CheckpointError, match="expected 0872f5d7"):
        de.resolve_default_embedding_model(tmp_path / "cache")
    assert not (tmp_path / "cache" / "all-MiniLM-L6-v2").exists()


def test_aliases_open_the_same_directory() -> None:
    path = minilm_dir()
    for name in ("all-minilm-l6-v2", "@cf/sentence-transformers/all-minilm-l6-v2"):
        assert open_checkpoint(name).path == path


def test_embed_cli_prints_shape_and_values_and_fails_in_one_line() -> None:
    minilm_dir()
    run = [sys.executable, "-m", "edgeinfer.cli", "embed", "--text", "hello world", "--text", "second text"]
    out = subprocess.run(run, capture_output=True, text=True, timeout=120, check=True).stdout.splitlines()
    assert out[0] == "shape: [2, 384]"
    first = [float(v) for v in out[1].split("[", 1)[1].removesuffix(", ...]").split(", ")]
    assert len(first) == 8 and all(abs(v) < 1 for v in first)
    bad = subprocess.run([*run[:4], "--model", "gemma-3-270m", "--text", "x"], capture_output=True, text=True)
    assert bad.returncode == 2
    assert (
        bad.stderr.strip()
        .splitlines()[-1]
        .startswith("edgeinfer embed: error: gemma-3-270m: not an embedding")
    )

"""The default model: chunk assembly with sha256 checks, the verified-file marker, names and aliases."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from edgeinfer.engine.cache_dir import models_cache_dir
from edgeinfer.engine.model.loader import (
    CheckpointError,
    is_default_model,
    open_checkpoint,
    resolve_default_model,
)
from edgeinfer.engine.model.loader.default_model import (
    MODEL_FILE,
    MODEL_SHA256,
    Chunk,
    assemble_chunks,
    installed_chunks,
)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def chunks(tmp_path: Path) -> list[Chunk]:
    out = []
    for i, data in enumerate([b"first chunk|", b"second|" * 1000, b"third"]):
        path = tmp_path / f"model.gguf.part{i:02d}"
        path.write_bytes(data)
        out.append(Chunk(path, sha(data), f"pkg-part{i + 1}"))
    return out


def whole(chunks: list[Chunk]) -> bytes:
    return b"".join(chunk.path.read_bytes() for chunk in chunks)


def test_assembles_verifies_and_marks(tmp_path: Path, chunks: list[Chunk]) -> None:
    target = tmp_path / "out" / "model.gguf"
    target.parent.mkdir()
    assemble_chunks(chunks, target, sha(whole(chunks)))
    assert target.read_bytes() == whole(chunks)
    assert sha(whole(chunks)) in (target.parent / "model.gguf.verified").read_text()
    assert sorted(p.name for p in target.parent.iterdir()) == ["model.gguf", "model.gguf.verified"]


def test_bad_chunk_is_named(tmp_path: Path, chunks: list[Chunk]) -> None:
    expected = sha(whole(chunks))
    chunks[1].path.write_bytes(b"second|" * 999 + b"SECOND|")  # same size, different bytes
    target = tmp_path / "model.gguf"
    with pytest.raises(CheckpointError, match=r"model\.gguf\.part01: chunk has sha256 .* package pkg-part2"):
        assemble_chunks(chunks, target, expected)
    assert not target.exists()
    assert not list(tmp_path.glob(".*.tmp"))  # the half-written file is gone


def test_bad_assembled_file_is_named(tmp_path: Path, chunks: list[Chunk]) -> None:
    unrecorded = [Chunk(chunk.path, None, chunk.package) for chunk in chunks]  # no per-chunk hashes to check
    target = tmp_path / "model.gguf"
    with pytest.raises(
        CheckpointError, match=rf"model\.gguf: assembled file has sha256 {sha(whole(chunks))}"
    ):
        assemble_chunks(unrecorded, target, "0" * 64)
    assert not target.exists()


def test_names_and_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert all(map(is_default_model, ["gemma-3-270m", "google/gemma-3-270m", "@cf/google/gemma-3-270m"]))
    assert not is_default_model("gemma-3-1b")
    with pytest.raises(CheckpointError, match="'gemma-3-1b' is not the default model"):
        resolve_default_model("gemma-3-1b")
    monkeypatch.setenv("EDGEINFER_CACHE_DIR", str(tmp_path))
    assert models_cache_dir() == tmp_path / "models"
    monkeypatch.delenv("EDGEINFER_CACHE_DIR")
    assert models_cache_dir() == Path.home() / ".cache" / "edgeinfer" / "models"


@pytest.mark.gemma
def test_chunks_carry_their_recorded_hashes(gemma_gguf: Path) -> None:
    found = installed_chunks()
    assert [chunk.path.name for chunk in found] == [f"{MODEL_FILE}.part{i:02d}" for i in range(4)]
    assert all(chunk.sha256 is not None and len(chunk.sha256) == 64 for chunk in found)
    assert sum(chunk.path.stat().st_size for chunk in found) == gemma_gguf.stat().st_size


@pytest.mark.gemma
def test_resolves_once_then_trusts_the_marker(gemma_gguf: Path, tmp_path: Path) -> None:
    target = resolve_default_model("google/gemma-3-270m", cache_dir=tmp_path)
    assert target == tmp_path / MODEL_FILE and target.stat().st_size == gemma_gguf.stat().st_size
    # Damage the file but keep its size and mtime: the marker still vouches for it, so no re-hash happens.
    stat = target.stat()
    with open(target, "r+b") as f:
        f.write(b"XXXX")
    os.utime(target, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert resolve_default_model(cache_dir=tmp_path).read_bytes()[:4] == b"XXXX"
    # Once the mtime moves, the file is hashed again, found wrong, and rebuilt from the chunks.
    os.utime(target, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert resolve_default_model(cache_dir=tmp_path).read_bytes()[:4] == b"GGUF"
    assert hashlib.sha256(target.read_bytes()).hexdigest() == MODEL_SHA256


@pytest.mark.gemma
def test_open_by_alias(gemma_gguf: Path) -> None:
    ckpt = open_checkpoint("@cf/google/gemma-3-270m")
    assert ckpt.path == gemma_gguf and ckpt.config["architectures"] == ["Gemma3ForCausalLM"]


def test_sizing_the_default_model_reads_no_header(default_gguf, monkeypatch):
    """The pool sizes a model and fingerprints it around its load; neither may parse the GGUF again."""
    from edgeinfer.engine.model.loader import checkpoint_location
    from edgeinfer.engine.model.loader.gguf_file import GGUFFile
    from edgeinfer.pool.loader import checkpoint_bytes, resolve_checkpoint_path

    def parsed(*args: object, **kwargs: object) -> None:
        raise AssertionError("the GGUF header was parsed")

    monkeypatch.setattr(GGUFFile, "__init__", parsed)
    assert checkpoint_location("gemma-3-270m") == default_gguf
    assert resolve_checkpoint_path("gemma-3-270m") == default_gguf
    assert checkpoint_bytes(default_gguf) == default_gguf.stat().st_size
    assert resolve_checkpoint_path("no-such-model") is None
    with pytest.raises(AssertionError, match="parsed"):
        open_checkpoint("gemma-3-270m")  # the check above would notice a parse

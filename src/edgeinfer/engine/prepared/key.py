"""What a prepared-form cache entry is keyed by, and where the caches live.

An entry is valid for one source checkpoint (its content), one set of load settings (dtype, device,
quantization), one layout of the runtime tensors and one CPU. The source's content hash is costly (it
reads every byte of the checkpoint), so it is stored beside the entries and reused while the files' stat key
(path, size, mtime, inode) is unchanged: replacing a file in place, or touching it, rehashes it.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from functools import cache
from pathlib import Path
from typing import Any

import torch

import edgeinfer
from edgeinfer.engine.checkpoint_files import read_weight_files

# Bump when the runtime form of any prepared module changes (a new kernel layout, renamed buffers, a new
# field on a module): every older entry then misses. The code fingerprint below catches most such changes
# on its own, but not a layout that depends on something outside the hashed sources (a compiler flag).
LAYOUT_VERSION = 1

# Sources whose code decides the runtime tensors; an edit to any of them misses every entry.
_CODE_DIRS = ("engine/model", "engine/quant", "engine/kernels")
_CODE_SUFFIXES = (".py", ".cpp")
_READ_BYTES = 8 << 20


def source_files(path: Path) -> list[Path]:
    """The files a checkpoint's weights and config come from (a file, or a directory's weight and JSON
    files)."""
    return read_weight_files(path, (".json",))


def source_digest(path: Path, root: Path) -> str:
    """sha256 over the checkpoint's files (names and bytes), reused while their stat key is unchanged."""
    files = source_files(path)
    stat_key = [[str(f.resolve()), *_stat(f)] for f in files]
    marker = root / "sources" / (hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:32] + ".json")
    try:
        recorded = json.loads(marker.read_text())
        if recorded["stat"] == stat_key:
            return str(recorded["sha256"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    digest = hashlib.sha256()
    for f in files:
        digest.update(f.name.encode() + b"\0")
        with open(f, "rb") as handle:
            while block := handle.read(_READ_BYTES):
                digest.update(block)
    value = digest.hexdigest()
    write_atomic(marker, json.dumps({"stat": stat_key, "sha256": value}).encode())
    return value


def _stat(f: Path) -> list[int]:
    s = f.stat()
    return [s.st_size, s.st_mtime_ns, s.st_ino]


@cache
def code_fingerprint() -> str:
    """sha256 of the engine's model, quantization and kernel sources."""
    package = Path(edgeinfer.__file__).parent
    digest = hashlib.sha256()
    for sub in _CODE_DIRS:
        for f in sorted((package / sub).rglob("*")):
            if f.suffix in _CODE_SUFFIXES:
                digest.update(str(f.relative_to(package)).encode() + b"\0" + f.read_bytes())
    return digest.hexdigest()


@cache
def cpu_fingerprint() -> str:
    """The CPU's model and feature flags: the CPU int4 layout and the kernels built depend on them."""
    info = ""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags", "Features", "CPU part"))]
        info = "".join(sorted(set(lines)))
    except OSError:
        pass
    return f"{platform.machine()}:{platform.processor()}:{hashlib.sha256(info.encode()).hexdigest()[:16]}"


def entry_key(source_sha256: str, settings: dict[str, Any]) -> str:
    """The entry name for a source and the load settings that shape its runtime tensors."""
    parts = {
        "source": source_sha256,
        "settings": settings,
        "layout": LAYOUT_VERSION,
        "code": code_fingerprint(),
        "torch": torch.__version__,
        "cpu": cpu_fingerprint(),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]


def write_atomic(path: Path, data: bytes) -> None:
    """Write `path` through a temporary file and a rename, so readers see the old or the new bytes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)

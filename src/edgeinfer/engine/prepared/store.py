"""The prepared-form cache: one safetensors file per entry, memory-mapped when it is loaded.

An entry holds the runtime tensors of a loaded model (dequantized bf16, or quantized tensors in the
kernels' layout) and, in its metadata, the snapshot spec (snapshot.py) and an xxh3-128 digest of every
tensor's bytes. Loading checks the digest before the tensors are used: a truncated file fails to open, a
flipped byte fails the digest, and either way the entry is deleted and the model is loaded afresh.
Entries are written to a temporary file and renamed, so a concurrent reader sees a whole entry or none.

The digest reads every byte, most of what a cached load does, so a load that found it right leaves a
stamp beside the entry (`KEY.verified`): the digest and the file's identity, its inode, size,
modification and change times. A later load of a file with that identity skips the hash: any write to the
file moves its change time, which no one can set back, and a replaced file is a new inode. What the stamp
gives up is a second look at a file no one wrote: a disk that flips a bit later.

A load marks its entry used (its mtime); writing an entry removes those unused for `UNUSED_DAYS`. A new
edgeinfer, torch or CPU keys every model afresh, and the entries it leaves behind (hundreds of MB each)
would otherwise stay forever. Age rather than lineage: two installs that share a cache directory each keep
their own entries while both are in use, instead of deleting each other's at every switch.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
import xxhash
from safetensors.torch import load_file, save_file
from torch import nn

from edgeinfer.engine.prepared.snapshot import NotCacheable, capture, restore

log = logging.getLogger(__name__)

_META_KEY = "edgeinfer.prepared"
UNUSED_DAYS = 14


class PreparedCache:
    """Entries under `directory`, named by `key.entry_key`."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def path(self, key: str) -> Path:
        return self.directory / f"{key}.safetensors"

    def load(self, key: str, build_meta: Callable[[], nn.Module]) -> nn.Module | None:
        """The cached model for `key` on a model from `build_meta()`, or None (missing or rejected)."""
        path = self.path(key)
        if not path.is_file():
            return None
        start = time.perf_counter()
        try:
            tensors, meta = _read(path)
            model = restore(build_meta(), tensors, meta["spec"])
        except Exception as e:  # any damage: unreadable header, digest mismatch, a spec that no longer fits
            log.warning("prepared cache entry %s rejected (%s); loading afresh", path, e)
            _remove(path)
            return None
        log.info("loaded the prepared model from %s in %.2f s", path, time.perf_counter() - start)
        _mark_used(path)
        _stamp_verified(path, meta["digest"])  # after the mark, which moves the change time
        return model

    def save(self, key: str, model: nn.Module, reference: nn.Module) -> bool:
        """Store `model` (prepared) for `key`; `reference` is a model built from the same config."""
        try:
            tensors, spec = capture(model, reference)
        except NotCacheable as e:
            log.info("not caching the prepared model: %s", e)
            return False
        path = self.path(key)
        self.directory.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        metadata = {_META_KEY: json.dumps({"spec": spec, "digest": _digest(tensors)})}
        try:
            save_file(tensors, str(tmp), metadata=metadata)
            os.replace(tmp, path)
        except OSError as e:  # a full disk or a read-only cache: serving goes on without the entry
            log.warning("could not write the prepared cache entry %s: %s", path, e)
            return False
        finally:
            tmp.unlink(missing_ok=True)
        log.info("cached the prepared model in %s", path)
        self._remove_unused(keep=path)
        return True

    def _remove_unused(self, keep: Path) -> None:
        cutoff = time.time() - UNUSED_DAYS * 86400
        for entry in self.directory.glob("*.safetensors"):
            try:
                if entry != keep and entry.stat().st_mtime < cutoff:
                    _remove(entry)
                    log.info("removed the prepared cache entry %s (unused for %d days)", entry, UNUSED_DAYS)
            except OSError:  # another process removed it first, or a read-only cache
                continue


def _mark_used(path: Path) -> None:
    with contextlib.suppress(OSError):  # a read-only cache still serves its entries
        os.utime(path)


def _remove(entry: Path) -> None:
    entry.unlink(missing_ok=True)
    _stamp(entry).unlink(missing_ok=True)


def _stamp(entry: Path) -> Path:
    return entry.with_suffix(".verified")


def _identity(path: Path) -> dict[str, int]:
    st = path.stat()
    return {"ino": st.st_ino, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns}


def _stamp_verified(path: Path, digest: str) -> None:
    with contextlib.suppress(OSError):  # a read-only cache: every load hashes
        _stamp(path).write_text(json.dumps({"digest": digest, **_identity(path)}))


def _already_verified(path: Path, digest: str) -> bool:
    try:
        stamp = json.loads(_stamp(path).read_text())
        return stamp == {"digest": digest, **_identity(path)}
    except (OSError, ValueError):  # no stamp, or one cut short
        return False


def _read(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """The entry's tensors and its metadata (`spec`, `digest`), the digest checked unless its stamp says
    this very file was checked before."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        meta = json.loads((handle.metadata() or {})[_META_KEY])
    tensors = load_file(str(path))  # memory-mapped: pages are read as the tensors are touched
    if not _already_verified(path, meta["digest"]) and _digest(tensors) != meta["digest"]:
        raise ValueError("tensor bytes do not match the entry's digest")
    return tensors, meta


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    """xxh3-128 over names, dtypes, shapes and bytes of every tensor, in name order."""
    h = xxhash.xxh3_128()
    for name in sorted(tensors):
        t = tensors[name]
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()))
    return h.hexdigest()

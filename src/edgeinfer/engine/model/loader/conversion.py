"""What checkpoint conversions (`edgeinfer quantize`, `edgeinfer compress`) read and write: a source of
tensors with its config, read from an HF safetensors directory or anything `open_checkpoint` opens, and
the side files (config, tokenizer) carried into the converted directory."""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from edgeinfer.engine.checkpoint_files import WEIGHT_SUFFIXES
from edgeinfer.engine.model.loader.codec import COMPRESSED_FILE, CompressStats, compress_tensors
from edgeinfer.engine.model.loader.errors import CheckpointError

log = logging.getLogger(__name__)

SAFETENSORS_INDEX = "model.safetensors.index.json"
#: files never carried into a converted checkpoint (weights, their index, loader caches' stamps)
_NOT_CARRIED = (SAFETENSORS_INDEX, "config.json", "edgeinfer_source.json")


@dataclass
class CheckpointSource:
    """What a conversion reads: an HF-shaped config, tensors (iterated once), and a directory whose
    tokenizer and generation files are carried into the output."""

    label: str
    config: dict[str, Any]
    tensors: Iterable[tuple[str, torch.Tensor]]
    side_dir: Path | None
    #: per module (checkpoint name): a state already quantized with the target method, written instead
    #: of quantizing the module's float weight (GPTQ's rounding)
    states: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)


def open_source(spec: str) -> CheckpointSource:
    """An HF safetensors directory as stored, or anything `open_checkpoint` opens (a `.gguf`, the default
    model's name), dequantized to bf16 with its tokenizer files built."""
    path = Path(spec).expanduser()
    if path.is_dir() and any(path.glob("*.safetensors")):
        return source_from_dir(path)
    from edgeinfer.engine.model.loader.opener import open_checkpoint
    from edgeinfer.engine.tokenizer import Tokenizer

    ckpt = open_checkpoint(spec)
    Tokenizer.from_checkpoint(ckpt)  # builds and caches tokenizer files for a GGUF, so they can be copied
    log.info("reading %s (%s), floating-point tensors as bf16", ckpt.path, ckpt.format)
    tensors = ckpt.iter_tensors(torch.bfloat16)
    return CheckpointSource(str(ckpt.path), ckpt.config, tensors, ckpt.tokenizer_dir)


def source_from_dir(src: Path) -> CheckpointSource:
    """An HF safetensors directory, tensors in their stored dtypes (nothing is cast)."""
    safetensors_files(src)  # fail early on an empty directory
    return CheckpointSource(str(src), read_config(src), iter_safetensors(src), src)


def safetensors_files(src: Path) -> list[Path]:
    """The weight files of a checkpoint directory, in a stable order."""
    if not src.is_dir():
        raise CheckpointError(f"{src} is not a directory")
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {src}")
    return files


def iter_safetensors(src: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream `(name, tensor)` from every safetensors file of a directory, one tensor in memory at a time."""
    for path in safetensors_files(src):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open handles are not iterable
                yield name, f.get_tensor(name)


def read_config(src: Path) -> dict[str, Any]:
    """config.json of a checkpoint directory (empty when there is none)."""
    path = src / "config.json"
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: invalid JSON ({e})") from None


def write_output_files(dst: Path, source: CheckpointSource, config: dict[str, Any]) -> list[str]:
    """Write `config` as dst/config.json and copy the source's other non-weight files; returns their names."""
    (dst / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    copied = []
    if source.side_dir is not None and source.side_dir.is_dir():
        for path in sorted(source.side_dir.iterdir()):
            if path.is_file() and path.suffix not in WEIGHT_SUFFIXES and path.name not in _NOT_CARRIED:
                shutil.copy2(path, dst / path.name)
                copied.append(path.name)
    return copied


def compress_checkpoint(source: CheckpointSource, dst: Path) -> CompressStats:
    """Write `dst/model.eiz` from `source`'s tensors (the lossless codec), plus its config and side files."""
    dst.mkdir(parents=True, exist_ok=True)
    stats = compress_tensors(source.tensors, dst / COMPRESSED_FILE, metadata={"source": source.label})
    write_output_files(dst, source, source.config)
    log.info("compressed %s: %s", source.label, stats.summary())
    return stats

"""An adapter's weights: read from `adapter_model.safetensors`, checked against the base, laid out per
module of ours (q/k/v share `qkv_proj`, gate/up share `gate_up_proj`)."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from edgeinfer.engine.lora.config import WEIGHTS_FILE, AdapterConfig, AdapterError, read_config
from edgeinfer.engine.lora.targets import BaseTargets

# PEFT saves `base_model.model.<the base's module path>.lora_A.weight`; the base's path may carry a
# `model.` or `model.language_model.` (multimodal Gemma 3) before `layers`.
_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?:model\.)?(?:language_model\.)?layers\.(\d+)\.(self_attn|mlp)\.(\w+)"
    r"\.lora_([AB])\.weight$"
)
_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn"}


# Output columns per block of a module's B (kernels/lora.cpp: kBlock).
BLOCK = 16


@dataclass(frozen=True)
class LoraSlice:
    """One targeted projection inside a module: `out[:, lo:hi] += h[:, r0:r0 + rank] @ B.T`, its B's
    columns in `b` from block `block` on."""

    lo: int
    hi: int
    r0: int
    block: int


@dataclass(frozen=True)
class ModuleLora:
    """The adapter on one module of ours: the A of every targeted projection stacked, so the module's
    input is multiplied once (`h = x @ a.T`), and their B laid out for the kernel (kernels/lora.cpp):
    transposed and cut into blocks of BLOCK output columns, each block's `rank x BLOCK` values together,
    so that one pass over `b` reads it start to end. Each projection starts a block; zeros pad its last."""

    a: torch.Tensor  # [sum of ranks, in_features]
    b: torch.Tensor  # [blocks, rank, BLOCK], PEFT's scale folded in
    slices: tuple[LoraSlice, ...]

    @property
    def rank(self) -> int:
        return self.b.shape[1]

    def bt(self, s: LoraSlice) -> torch.Tensor:
        """`[rank, hi - lo]`: the slice's B, transposed (a copy, for the torch ops)."""
        blocks = self.b[s.block : s.block + _blocks(s.hi - s.lo)]
        return blocks.permute(1, 0, 2).reshape(self.rank, -1)[:, : s.hi - s.lo]

    def plan(self) -> list[int]:
        """The slices as `lora_add`'s plan lists them: their count, then lo, hi, r0, block of each."""
        return [len(self.slices), *(v for s in self.slices for v in (s.lo, s.hi, s.r0, s.block))]


def module_lora(
    projections: list[tuple[int, int, torch.Tensor, torch.Tensor]], scale: float, dtype: torch.dtype
) -> ModuleLora:
    """The layout of a module's projections, each as (lo, hi, PEFT's A [r, in], B [hi - lo, r])."""
    slices, blocks, r0, block = [], [], 0, 0
    for lo, hi, a, b in projections:
        n = _blocks(hi - lo)
        # the scale folded into B in fp32, before any rounding to the serving dtype
        padded = torch.zeros(n * BLOCK, b.shape[1])
        padded[: hi - lo] = b.float() * scale
        blocks.append(padded.reshape(n, BLOCK, -1).transpose(1, 2))
        slices.append(LoraSlice(lo, hi, r0, block))
        r0, block = r0 + a.shape[0], block + n
    a = torch.cat([a.float() for _, _, a, _ in projections])
    return ModuleLora(a.to(dtype).contiguous(), torch.cat(blocks).to(dtype).contiguous(), tuple(slices))


def _blocks(columns: int) -> int:
    return -(-columns // BLOCK)


@dataclass(frozen=True)
class LoraWeights:
    name: str
    config: AdapterConfig
    fingerprint: str  # sha256 of the config and weight files: equal content, equal KV
    modules: dict[tuple[int, str], ModuleLora]  # (layer, our module) -> its LoRA
    nbytes: int


def file_bytes(directory: Path) -> int:
    path = directory / WEIGHTS_FILE
    if not path.is_file():
        raise AdapterError(f"{directory} has no {WEIGHTS_FILE} (only safetensors adapters are read)")
    return path.stat().st_size


def load_adapter(
    name: str, directory: Path, targets: BaseTargets, dtype: torch.dtype, max_bytes: int
) -> LoraWeights:
    """Read and check the adapter; every error is an AdapterError with a one-line message."""
    config = read_config(directory)
    size = file_bytes(directory)
    if size > max_bytes:
        raise AdapterError(f"{WEIGHTS_FILE} is {size} bytes, over the limit of {max_bytes}")
    pairs = _read_pairs(directory / WEIGHTS_FILE, config, targets)
    modules = _lay_out(pairs, targets, config.scale, dtype)
    nbytes = sum(t.numel() * t.element_size() for m in modules.values() for t in (m.a, m.b))
    return LoraWeights(name, config, _fingerprint(directory), modules, nbytes)


def _read_pairs(
    path: Path, config: AdapterConfig, targets: BaseTargets
) -> dict[tuple[int, str], dict[str, torch.Tensor]]:
    """(layer, HF projection) -> {"A": [r, in], "B": [out, r]}, every name and shape checked first."""
    try:
        with safe_open(str(path), framework="pt") as f:
            keys = list(f.keys())
            for key in keys:
                _check_shape(key, f.get_slice(key).get_shape(), config, targets)
            pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
            for key in keys:
                layer, proj, side = _parse_key(key, targets)
                pairs.setdefault((layer, proj), {})[side] = f.get_tensor(key)
    except SafetensorError as e:
        raise AdapterError(f"{path.name} cannot be read: {e}") from None
    if not pairs:
        raise AdapterError(f"{path.name} holds no LoRA tensors")
    for (layer, proj), pair in pairs.items():
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"layers.{layer}.{proj} has lora_{''.join(pair)} without its pair")
        if proj not in config.target_modules:
            raise AdapterError(f"layers.{layer}.{proj} has weights but is not in target_modules")
        for t in pair.values():
            if not t.is_floating_point() or not bool(torch.isfinite(t).all()):
                raise AdapterError(f"layers.{layer}.{proj} holds non-float or non-finite values")
    return pairs


def _parse_key(key: str, targets: BaseTargets) -> tuple[int, str, str]:
    m = _KEY.match(key)
    if m is None:
        raise AdapterError(f"unexpected tensor {key!r} (only lora_A / lora_B of layer projections)")
    layer, parent, proj, side = int(m[1]), m[2], m[3], m[4]
    if proj not in targets.projections or _PARENT.get(proj, "mlp") != parent:
        raise AdapterError(f"target module {parent}.{proj} is not one of this base's projections")
    if layer >= targets.num_layers:
        raise AdapterError(f"adapter targets layer {layer}; the base has {targets.num_layers} layers")
    return layer, proj, side


def _check_shape(key: str, shape: list[int], config: AdapterConfig, targets: BaseTargets) -> None:
    layer, proj, side = _parse_key(key, targets)
    t = targets.projections[proj]
    want = [config.rank, t.in_features] if side == "A" else [t.hi - t.lo, config.rank]
    if list(shape) != want:
        raise AdapterError(
            f"lora_{side} of layers.{layer}.{proj} is {list(shape)}, the base needs {want} (another base?)"
        )


def _lay_out(
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]],
    targets: BaseTargets,
    scale: float,
    dtype: torch.dtype,
) -> dict[tuple[int, str], ModuleLora]:
    by_module: dict[tuple[int, str], list[tuple[str, dict[str, torch.Tensor]]]] = {}
    for (layer, proj), pair in sorted(pairs.items()):
        by_module.setdefault((layer, targets.projections[proj].module), []).append((proj, pair))
    out = {}
    for key, items in by_module.items():
        projections = []
        for proj, pair in items:
            t = targets.projections[proj]
            projections.append((t.lo, t.hi, pair["A"], pair["B"]))
        out[key] = module_lora(projections, scale, dtype)
    return out


def _fingerprint(directory: Path) -> str:
    h = hashlib.sha256()
    for name in ("adapter_config.json", WEIGHTS_FILE):
        with open(directory / name, "rb") as f:
            h.update(hashlib.file_digest(f, "sha256").digest())
    return h.hexdigest()

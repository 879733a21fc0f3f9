"""`edgeinfer quantize` with calibration: the same input scaling (and int4 states on energy-weighted grids)
as quantizing at load, written into the float tensors (and states) the converter then writes.

The model is built from the checkpoint in fp32, calibrated (quant/smoothing.py), and every tensor of a
module it changed replaces the checkpoint's tensor of the same name; fused modules (`qkv_proj`,
`gate_up_proj`) are split back into the checkpoint's parts. The lm_head is not scaled here: a tied
checkpoint has one table for the lm_head and the embedding, and the format has no place for the lookup
factor (`ScaledEmbedding`) that keeps them shared at load. Nor is int8 rotated: compressed-tensors' int8
format is unrotated, so an offline int8 checkpoint is what other engines can read.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import torch
from torch import nn

from edgeinfer.engine.model.loader.conversion import CheckpointSource
from edgeinfer.engine.quant.apply import SkipRule, make_skip
from edgeinfer.engine.quant.base import WeightMethod

log = logging.getLogger(__name__)


def calibrated_source(
    spec: str,
    source: CheckpointSource,
    method: WeightMethod,
    skip: SkipRule = None,
    gptq: str | None = None,
) -> CheckpointSource:
    """`source` with the tensors that calibration changed replaced (fp32); `skip`ped modules untouched.
    With `gptq` (its calibration text), int4 decoder layers carry GPTQ's states instead."""
    from edgeinfer.engine.loading import calibrate, load_model
    from edgeinfer.engine.model.loader import open_checkpoint

    ckpt = open_checkpoint(spec)
    cpu = torch.device("cpu")
    model = load_model(ckpt, torch.float32, cpu)
    report = calibrate(model, ckpt, method, torch.float32, cpu, gptq, make_skip(skip))
    log.info("calibration changed %d modules", len(report.changed))
    replacements = dict(checkpoint_tensors(model, report.changed - set(report.states)))
    states = dict(checkpoint_states(model, method, report.states))
    tensors = ((name, replacements.get(name, t)) for name, t in source.tensors)
    return CheckpointSource(source.label, source.config, tensors, source.side_dir, states)


def checkpoint_tensors(model: nn.Module, modules: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, tensor) of the weights and biases of `modules`, fused layers split into parts."""
    for name in sorted(modules):
        module = model.get_submodule(name)
        parts = _parts(model, name)
        for param in ("weight", "bias"):
            t = getattr(module, param, None)
            if t is None:
                continue
            t = t.detach()
            if not parts:
                yield f"{name}.{param}", t.clone()
                continue
            start = 0
            for part, rows in parts:
                yield f"{name.rsplit('.', 1)[0]}.{part}.{param}", t[start : start + rows].clone()
                start += rows


def checkpoint_states(
    model: nn.Module, method: WeightMethod, states: dict[str, dict[str, torch.Tensor]]
) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
    """(checkpoint module, state) of quantized `states`, fused layers' states split into their parts
    (row ranges of the unpacked codes and scales, repacked)."""
    for name, state in sorted(states.items()):
        parts = _parts(model, name)
        if not parts:
            yield name, state
            continue
        unpacked = method.unpack(state)
        start = 0
        for part, rows in parts:
            piece = {k: v[start : start + rows] for k, v in unpacked.items()}
            yield f"{name.rsplit('.', 1)[0]}.{part}", method.pack(piece)
            start += rows


def _parts(model: nn.Module, name: str) -> list[tuple[str, int]]:
    """The checkpoint modules a fused layer is made of, with their row counts; [] for an unfused one."""
    leaf = name.rsplit(".", 1)[-1]
    parent = model.get_submodule(name.rsplit(".", 1)[0])
    if leaf == "qkv_proj":
        return [("q_proj", parent.q_size), ("k_proj", parent.kv_size), ("v_proj", parent.kv_size)]
    if leaf == "gate_up_proj":
        return [("gate_proj", parent.intermediate), ("up_proj", parent.intermediate)]
    return []

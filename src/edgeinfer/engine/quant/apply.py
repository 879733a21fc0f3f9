"""Quantize a model in place: swap `nn.Linear` (and optionally `nn.Embedding`) for quantized modules."""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Callable, Iterable

import torch
from torch import nn

from edgeinfer.engine.quant.base import WeightMethod, get_weight_method
from edgeinfer.engine.quant.layers import QuantEmbedding, QuantLinear

log = logging.getLogger(__name__)

SkipRule = Callable[[str], bool] | Iterable[str] | None


def is_lm_head(name: str) -> bool:
    """Output projections by their usual names."""
    last = name.rsplit(".", 1)[-1]
    return last in ("lm_head", "output", "embed_out")


def make_skip(skip: SkipRule) -> Callable[[str], bool]:
    """A predicate from a callable, or from fnmatch patterns over module names (`*.lm_head`, `vision.*`)."""
    if skip is None:
        return lambda name: False
    if callable(skip):
        return skip
    patterns = tuple(skip)
    return lambda name: any(fnmatch.fnmatchcase(name, p) for p in patterns)


def quantize_model(
    model: nn.Module,
    method: str | WeightMethod,
    skip: SkipRule = None,
    *,
    quantize_lm_head: bool = False,
    quantize_embeddings: bool = False,
    head_method: str | WeightMethod | None = None,
    device: torch.device | str | None = None,
    states: dict[str, dict[str, torch.Tensor]] | None = None,
) -> nn.Module:
    """Replace the model's `nn.Linear` modules with `QuantLinear` in place; return the model.

    `skip` names modules to keep in full precision. The lm_head and embeddings are kept unless asked for;
    when both are quantized and share one tensor (tied weights), int8/fp8 layers share one quantized copy.
    `head_method` (default: `method`) quantizes the lm_head and embeddings, so an int4 model can keep an
    int8 output layer as llama.cpp's Q4_K_M keeps its token embedding in Q8_0.
    `states` maps module names to states already quantized with `method` (GPTQ's), used as they are.
    Quantize after the model is on its serving device (the CPU int4 layout is built for the CPU it runs on).
    A module holding weights of another shape (fused `[E, out, in]` experts) joins in by defining
    `quantize_weights(method)`, typically swapping its parameters for `quantize_expert_weights(...)`.
    """
    m = get_weight_method(method)
    head = m if head_method is None else get_weight_method(head_method)
    skipped = make_skip(skip)
    given = states or {}
    cache: dict[tuple, dict[str, torch.Tensor]] = {}  # (weight, method) -> its state (tied weights)
    replaced = 0
    for name, module in list(model.named_modules()):
        if not name or skipped(name):
            continue
        hook = getattr(module, "quantize_weights", None)
        if callable(hook):  # modules with other weight shapes (fused MoE experts) quantize themselves
            hook(m)
            replaced += 1
            continue
        if isinstance(module, nn.Linear):
            if is_lm_head(name) and not quantize_lm_head:
                continue
            lm = head if is_lm_head(name) else m
            state = given[name] if name in given else _state_for(lm, module.weight, cache)
            dev = device if device is not None else module.weight.device
            new: nn.Module = QuantLinear(lm, lm.prepare(state, dev), module.bias)
        elif isinstance(module, nn.Embedding) and quantize_embeddings:
            new = QuantEmbedding(head, _state_for(head, module.weight, cache), module.weight.dtype)
        else:
            continue
        set_submodule(model, name, new)
        replaced += 1
    log.info("quantized %d modules with %r", replaced, m)
    return model


def _state_for(m: WeightMethod, weight: torch.Tensor, cache: dict[tuple, dict[str, torch.Tensor]]) -> dict:
    key = (id(weight), repr(m))
    if key not in cache:
        cache[key] = m.quantize(weight.detach())
    return cache[key]


def set_submodule(model: nn.Module, name: str, new: nn.Module) -> None:
    """Replace the submodule at dotted `name`."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)

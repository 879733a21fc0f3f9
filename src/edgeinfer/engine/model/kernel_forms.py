"""Layers as our one-call C++ steps take them (kernels: dense_step.cpp, moe_block.cpp): the tensors
and numbers of each weight form the kernels read, or None where a layer has a form they do not."""

from __future__ import annotations

import torch
from torch import nn

from edgeinfer.engine.kernels.bf16 import GemvLinear
from edgeinfer.engine.kernels.lossless import LosslessExperts, LosslessLinear, form_of
from edgeinfer.engine.quant.experts import QuantizedExperts
from edgeinfer.engine.quant.layers import QuantLinear

Form = tuple[dict[str, torch.Tensor], dict[str, float]]


def linear_form(linear: nn.Module) -> Form | None:
    """A linear as `bf16_gemv`, `lossless_gemv` or `int4_gemv` multiplies it, as its forward would."""
    bias = {"bias": linear.bias} if getattr(linear, "bias", None) is not None else {}
    if isinstance(linear, GemvLinear) and linear.weight.dtype == torch.bfloat16:
        return {"weight": linear.weight.detach()} | bias, {}
    if isinstance(linear, LosslessLinear):
        return form_of(linear).tensors() | bias, {}
    if isinstance(linear, QuantLinear) and linear.kernel == "cpu_w4a8":
        t = linear.prepared().tensors
        names = ("codes", "scales", "zero_terms")
        return {n: t[n] for n in names} | bias, {"group": linear.method.group_size}
    return None


def experts_form(stack: nn.Parameter | QuantizedExperts | LosslessExperts) -> Form | None:
    """A stack of experts' weights `[E, N, K]` in bf16, in the lossless form, or in the int4 kernel's
    layout."""
    if isinstance(stack, LosslessExperts):
        return form_of(stack).tensors(), {"experts": stack.num_experts}
    if isinstance(stack, QuantizedExperts):
        if stack.kernel != "cpu_w4a8":
            return None
        t = stack.prepared().tensors
        return {n: t[n] for n in ("codes", "scales", "zero_terms")}, {"group": stack.method.group_size}
    if stack.dtype == torch.bfloat16 and stack.is_contiguous() and stack.device.type == "cpu":
        return {"weight": stack.detach()}, {}
    return None


def prefixed(name: str, form: Form) -> Form:
    """`form` with every key named `<name>.<key>`."""
    tensors, numbers = form
    return {f"{name}.{k}": t for k, t in tensors.items()}, {f"{name}.{k}": v for k, v in numbers.items()}

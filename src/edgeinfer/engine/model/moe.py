"""Mixture-of-experts feed-forward: a router picks `top_k` experts per token, the experts run grouped.

Execution groups tokens by expert: the `T × top_k` (token, expert) pairs are sorted by expert, each active
expert runs one gate-up and one down matmul over its contiguous slice of gathered tokens (a grouped GEMM),
and the results are scattered back and summed with the routing weights. Nothing loops over tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from edgeinfer.engine.kernels import ops
from edgeinfer.engine.kernels.limits import KernelLimits
from edgeinfer.engine.kernels.lossless import LosslessExperts
from edgeinfer.engine.model.kernel_forms import Form, experts_form, linear_form, prefixed
from edgeinfer.engine.model.layers.activation import get_activation
from edgeinfer.engine.model.layers.mlp import ACT_CODES, GatedMLP
from edgeinfer.engine.model.routing import RouterSpec, TopKRouter
from edgeinfer.engine.quant.base import WeightMethod
from edgeinfer.engine.quant.experts import QuantizedExperts, quantize_expert_weights

# The routed experts' parameters, each a stack `[num_experts, out, in]`.
EXPERT_STACKS = ("gate_up_proj", "down_proj")

# dtypes given to the CPU grouped GEMM; others (fp16) take the per-expert loop.
_GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True)
class MoeSpec:
    """One sparse MoE block: `router.num_experts` routed experts of width `intermediate`, plus an always-on
    shared expert MLP of width `shared_intermediate` (0 = none; DeepSeek/GLM fuse their `n_shared_experts`
    into one MLP of `n_shared_experts × moe_intermediate_size`)."""

    hidden: int
    intermediate: int
    shared_intermediate: int
    act: str
    router: RouterSpec


class FusedExperts(nn.Module):
    """All routed experts of a layer as two 3-D parameters, named as transformers v5 names them:
    `gate_up_proj` `[E, 2·I, H]` (gate rows first, then up) and `down_proj` `[E, H, I]`.

    Each projection over the expert-sorted rows is one grouped GEMM (`F.grouped_mm`: every expert's matmul
    over its contiguous slice of rows, in one call), which is faster than one `F.linear` per active expert on
    CPU in bf16 because it pays one call's overhead for all of them. It is used on CPU for fp32 / bf16 weights
    whose rows (`H`, `I` values) are multiples of 16 bytes; anything else runs one `F.linear` per active
    expert.
    """

    def __init__(self, num_experts: int, hidden: int, intermediate: int, act: str) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.intermediate = intermediate
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.act = get_activation(act)

    def quantize_weights(self, method: WeightMethod, names: tuple[str, ...] = EXPERT_STACKS) -> None:
        """Swap the float stacks `names` (both by default) for quantized ones; every expert is then one
        quantized matmul over its rows. The loader calls this for each stack as soon as it is filled, so a
        model never holds more than one float stack; `quantize_model` then finds them quantized already."""
        for name in names:
            weight = getattr(self, name)
            if isinstance(weight, QuantizedExperts):
                continue
            stacked = quantize_expert_weights(weight.detach(), method)
            delattr(self, name)  # a Parameter slot cannot take a module
            setattr(self, name, stacked)

    def use_lossless(self) -> int:
        """Swap the bf16 stacks for their lossless form (kernels/lossless.py) where it slices by expert;
        returns how many changed."""
        swapped = 0
        for name in EXPERT_STACKS:
            weight = getattr(self, name)
            if not isinstance(weight, nn.Parameter) or (stack := LosslessExperts.of(weight)) is None:
                continue
            delattr(self, name)  # a Parameter slot cannot take a module
            setattr(self, name, stack)
            swapped += 1
        return swapped

    @property
    def uses_grouped_mm(self) -> bool:
        """Whether the grouped GEMM runs (decided by the current device, dtype and widths)."""
        w = self.down_proj
        if isinstance(w, QuantizedExperts):
            return False
        if isinstance(w, LosslessExperts):  # decoded for the call: bf16 where the form lies
            dtype, device = torch.bfloat16, w.low_bytes.device
        else:
            dtype, device = w.dtype, w.device
        aligned = all(dim * dtype.itemsize % 16 == 0 for dim in w.shape[1:])
        return device.type == "cpu" and dtype in _GROUPED_MM_DTYPES and aligned

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, H], expert_ids / weights [T, k] → Σ_j weights[t, j] · expert_{ids[t, j]}(x[t]), [T, H]."""
        num_tokens, top_k = expert_ids.shape
        flat = expert_ids.flatten()
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert, token order kept
        counts = torch.bincount(flat, minlength=self.num_experts)
        gate_up = self._grouped(x[order // top_k], self.gate_up_proj, counts)
        gate, up = gate_up.split(self.intermediate, dim=-1)
        out = self._grouped(self.act(gate) * up, self.down_proj, counts)
        pairs = torch.empty_like(out)
        pairs[order] = out  # back to (token, slot) order
        # Routing weights may be fp32 (sigmoid routers); HF multiplies in their dtype, then casts back.
        weighted = (pairs.view(num_tokens, top_k, -1) * weights.unsqueeze(-1)).to(x.dtype)
        return weighted.sum(dim=1)

    def _grouped(
        self, rows: torch.Tensor, w: torch.Tensor | QuantizedExperts | LosslessExperts, counts: torch.Tensor
    ) -> torch.Tensor:
        """rows [N, in] sorted by expert, `counts[e]` of them for expert e → rows @ w[e].T, [N, out]."""
        if isinstance(w, LosslessExperts):
            w = w.weight  # the stack decoded for this call: the same products as the bf16 stack's
        if self.uses_grouped_mm:
            return F.grouped_mm(rows, w.transpose(1, 2), offs=counts.cumsum(0).to(torch.int32))
        quantized = isinstance(w, QuantizedExperts)
        out = rows.new_empty(rows.shape[0], w.out_features if quantized else w.shape[1])
        start = 0
        for e, n in enumerate(counts.tolist()):
            if n:
                part = rows[start : start + n]
                out[start : start + n] = w.linear(part, e) if quantized else F.linear(part, w[e])
                start += n
        return out


class SparseMoeBlock(nn.Module):
    """Router + routed experts (+ shared experts). HF names: `gate`, `experts`, `shared_experts`.

    With `use_kernel` the whole block runs as one call of our C++ block (kernels/moe_block.cpp) for
    bf16 inputs: it routes, runs each chosen expert once over all its tokens and combines, rounding where
    the torch form below rounds (tests/models_moe/test_moe_kernel.py compares them)."""

    def __init__(self, spec: MoeSpec) -> None:
        super().__init__()
        self.spec = spec
        self.gate = TopKRouter(spec.router, spec.hidden)
        self.experts = FusedExperts(spec.router.num_experts, spec.hidden, spec.intermediate, spec.act)
        self.shared_experts = (
            GatedMLP(spec.hidden, spec.shared_intermediate, spec.act) if spec.shared_intermediate else None
        )
        self.kernel_block: Any = None  # our MoeBlock (kernels.ops.moe_block), once switched on

    def use_kernel(self, limits: KernelLimits) -> bool:
        """Run through our MoE block where every weight has a form it reads (bf16, or int4 in the kernel's
        layout; call after `kernels.load()` and after the layers took their kernel forms); False, and
        nothing changed, where some weight has not."""
        form = self.kernel_form(limits)
        if form is None:
            return False
        self.kernel_block = ops.moe_block(*form)
        return True

    def kernel_form(self, limits: KernelLimits) -> Form | None:
        """The block as MoeBlock's constructor takes it (tensors and numbers by name), or None."""
        spec, router = self.spec.router, self.gate
        experts = self.experts
        parts = {"gate_up": experts_form(experts.gate_up_proj), "down": experts_form(experts.down_proj)}
        if self.shared_experts is not None:
            parts["shared_gate_up"] = linear_form(self.shared_experts.gate_up_proj)
            parts["shared_down"] = linear_form(self.shared_experts.down_proj)
        act = ACT_CODES.get(self.spec.act)
        if act is None or any(form is None for form in parts.values()):
            return None
        sigmoid = spec.scoring == "sigmoid"
        if router.weight.dtype != (torch.float32 if sigmoid else torch.bfloat16):
            return None
        tensors = {"router.weight": router.weight.detach()}
        if sigmoid:
            tensors["router.bias"] = router.e_score_correction_bias.detach()
        numbers = {
            "top_k": spec.top_k,
            "sigmoid": float(sigmoid),
            "normalize": float(spec.norm_topk_prob),
            "n_group": spec.n_group,
            "topk_group": spec.topk_group,
            "scaling": spec.routed_scaling_factor,
            "act": act,
            "gemv_rows": limits.bf16_gemv_rows,
            "max_elements": limits.decode_op_elements,
        }
        for name, form in parts.items():
            assert form is not None
            more_tensors, more_numbers = prefixed(name, form)
            tensors |= more_tensors
            numbers |= more_numbers
        return tensors, numbers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (
            self.kernel_block is not None
            and x.dtype == torch.bfloat16
            and x.dim() == 2
            and not torch.compiler.is_compiling()
        ):
            return self.kernel_block.forward(x)
        weights, expert_ids = self.gate(x)
        out = self.experts(x, expert_ids, weights)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out

"""Quantized MoE expert weights stored fused as `[num_experts, out, in]`.

Every method quantizes row-wise, so a stack of experts quantizes in one call and expert `e`'s runtime
tensors are plain views `tensor[e]`; a matmul on a subset of experts touches only those experts' bytes.
"""

from __future__ import annotations

import torch

from edgeinfer.engine.quant.base import PreparedWeight, QuantizationError, WeightMethod, get_weight_method
from edgeinfer.engine.quant.layers import PreparedModule


class QuantizedExperts(PreparedModule):
    """`num_experts` quantized `[out, in]` matrices with one method; `linear(x, e)` is `x @ W_e.T`."""

    def __init__(self, method: WeightMethod, prepared: PreparedWeight, num_experts: int) -> None:
        super().__init__()
        self.method = method
        self.num_experts = num_experts
        self.out_features = prepared.out_features
        self.in_features = prepared.in_features
        self._hold(prepared)

    def expert(self, index: int) -> PreparedWeight:
        """Runtime weight of one expert (views, no copy)."""
        if not 0 <= index < self.num_experts:
            raise QuantizationError(f"expert index {index} out of range [0, {self.num_experts})")
        return self.prepared().select(index)

    def linear(self, x: torch.Tensor, index: int) -> torch.Tensor:
        """`x [M, in] @ W_index.T -> [M, out]` in `x.dtype`."""
        if x.dim() != 2 or x.shape[-1] != self.in_features:
            raise QuantizationError(f"expert input must be [M, {self.in_features}], got {tuple(x.shape)}")
        return self.method.apply(self.expert(index), x)

    def grouped_linear(self, x: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        """Row `i` of `x` times expert `expert_ids[i]`: `[M, in] -> [M, out]`, one matmul per distinct expert.

        Rows are grouped by expert (a stable sort), so an expert's tokens share one matmul.
        """
        if expert_ids.shape != x.shape[:1]:
            raise QuantizationError(
                f"expert_ids shape {tuple(expert_ids.shape)} does not match x {tuple(x.shape)}"
            )
        out = x.new_empty(x.shape[0], self.out_features)
        order = torch.argsort(expert_ids, stable=True)
        ids_sorted = expert_ids[order]
        experts, counts = torch.unique_consecutive(ids_sorted, return_counts=True)
        start = 0
        for e, n in zip(experts.tolist(), counts.tolist(), strict=True):
            rows = order[start : start + n]
            out[rows] = self.linear(x[rows], e)
            start += n
        return out

    def dequantize(self, index: int, dtype: torch.dtype) -> torch.Tensor:
        """Float weight of one expert (tests, debugging): the identity multiplied through the kernel."""
        eye = torch.eye(self.in_features, dtype=dtype, device=self._device())
        return self.linear(eye, index).t().contiguous()

    def _device(self) -> torch.device:
        return getattr(self, self._names[0]).device

    def extra_repr(self) -> str:
        return (
            f"experts={self.num_experts}, in={self.in_features}, out={self.out_features}, "
            f"method={self.method!r}, kernel={self.kernel}"
        )


def quantize_expert_weights(
    w3d: torch.Tensor, method: str | WeightMethod, device: torch.device | str | None = None
) -> QuantizedExperts:
    """Quantize fused expert weights `[num_experts, out, in]`."""
    if w3d.dim() != 3:
        raise QuantizationError(f"expert weights must be [num_experts, out, in], got {tuple(w3d.shape)}")
    m = get_weight_method(method)
    prepared = m.prepare(m.quantize(w3d.detach()), w3d.device if device is None else device)
    return QuantizedExperts(m, prepared, w3d.shape[0])


def experts_from_state(
    state: dict[str, torch.Tensor], method: str | WeightMethod, device: torch.device | str = "cpu"
) -> QuantizedExperts:
    """Build from a stacked saved state (each tensor has a leading expert dim)."""
    m = get_weight_method(method)
    prepared = m.prepare(state, device)
    return QuantizedExperts(m, prepared, next(iter(state.values())).shape[0])

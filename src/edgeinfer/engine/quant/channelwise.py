"""Shared base of the per-output-channel methods (int8, fp8): `weight` + `weight_scale [..., out, 1]`."""

from __future__ import annotations

from abc import abstractmethod
from typing import ClassVar

import torch

from edgeinfer.engine.quant.base import PreparedWeight, QuantizationError, WeightMethod, row_chunks


class ChannelwiseMethod(WeightMethod):
    """One scale per output row; the state is already the runtime form (no repacking)."""

    storage_dtype: ClassVar[torch.dtype]

    @abstractmethod
    def quantize_rows(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`[..., K]` -> (`storage_dtype` values `[..., K]`, fp32 scale `[..., 1]`)."""

    @abstractmethod
    def widen(self, q: torch.Tensor) -> torch.Tensor:
        """Stored values -> a float tensor holding them exactly."""

    def transform(self, rows: torch.Tensor) -> torch.Tensor:
        """What is quantized of a weight's rows `[..., K]` (int8 rotates them); by default the rows."""
        return rows

    def quantize(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        if weight.dim() < 2:
            raise QuantizationError(f"{self.name} quantizes matrices, got shape {tuple(weight.shape)}")
        rows = weight.detach().reshape(-1, weight.shape[-1])
        q = torch.empty(rows.shape, dtype=self.storage_dtype, device=weight.device)
        scale = torch.empty(rows.shape[0], 1, dtype=torch.float32, device=weight.device)
        for part in row_chunks(*rows.shape):
            q[part], scale[part] = self.quantize_rows(self.transform(rows[part]))
        return {"weight": q.view(weight.shape), "weight_scale": scale.view(*weight.shape[:-1], 1)}

    def dequantize(self, state: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        return (self.widen(state["weight"]).float() * state["weight_scale"].float()).to(dtype)

    def unpack(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return dict(state)

    def pack(self, unpacked: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return dict(unpacked)

    def prepare(self, state: dict[str, torch.Tensor], device: torch.device | str) -> PreparedWeight:
        self.check_state(state)
        q = state["weight"].to(device).contiguous()
        if q.dtype != self.storage_dtype:
            raise QuantizationError(f"{self.name} weight has dtype {q.dtype}, expected {self.storage_dtype}")
        scale = state["weight_scale"].to(device=device, dtype=torch.float32).reshape(q.shape[:-1])
        kernel = self.kernel_for_device(q.device)
        return PreparedWeight(kernel, {"weight": q, "weight_scale": scale}, q.shape[-2], q.shape[-1])

    def kernel_for_device(self, device: torch.device) -> str:
        """Default kernel name recorded in the prepared weight."""
        return "dequant"

    def embedding_rows(
        self, state: dict[str, torch.Tensor], ids: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        rows = self.widen(state["weight"][ids]).float()
        return (rows * state["weight_scale"].reshape(state["weight"].shape[:-1])[ids].unsqueeze(-1)).to(dtype)

    def state_names(self) -> tuple[str, ...]:
        return ("weight", "weight_scale")

"""Modules that stand in for `nn.Linear` / `nn.Embedding` with quantized weights."""

from __future__ import annotations

import torch
from torch import nn

from edgeinfer.engine.kernels.bf16 import GemvLinear
from edgeinfer.engine.kernels.lossless import LosslessLinear
from edgeinfer.engine.quant.base import (
    PreparedWeight,
    QuantizationError,
    WeightMethod,
    flatten_tokens,
    get_weight_method,
)


class PreparedModule(nn.Module):
    """A module whose quantized weight (one matrix or a stack of experts) is a `PreparedWeight` kept as
    buffers named after its tensors, so `.to()`, `state_dict()` and memory accounting see them."""

    method: WeightMethod
    out_features: int
    in_features: int

    def _hold(self, prepared: PreparedWeight) -> None:
        self.kernel = prepared.kernel
        self._names = tuple(prepared.tensors)
        for name, tensor in prepared.tensors.items():
            self.register_buffer(name, tensor)

    def prepared(self) -> PreparedWeight:
        """The runtime weight (current buffers, so it follows `.to()`)."""
        tensors = {n: getattr(self, n) for n in self._names}
        return PreparedWeight(self.kernel, tensors, self.out_features, self.in_features)

    def use_cpu_gemv(self) -> bool:
        """Switch to the form our CPU GEMV kernels read (`WeightMethod.gemv_form`; call `kernels.load()`
        first), in place of the current one; False, and nothing changed, where the method has none."""
        form = self.method.gemv_form(self.prepared())
        if form is None:
            return False
        for name in self._names:
            delattr(self, name)
        self._hold(form)
        return True

    def weight_nbytes(self) -> int:
        """Bytes of quantized weight storage (bias excluded)."""
        return self.prepared().nbytes()


class QuantLinear(PreparedModule):
    """`y = x @ W.T + b` with `W` held by a weight method in its runtime form.

    The runtime tensors are buffers (so `.to()`, `state_dict()` and memory accounting see them), but the
    CPU int4 layout is machine-specific: build layers on the device they will run on, from a float weight
    (`from_float`) or from a checkpoint state (`from_state`).
    """

    def __init__(
        self, method: WeightMethod, prepared: PreparedWeight, bias: torch.Tensor | None = None
    ) -> None:
        super().__init__()
        self.method = method
        self.in_features = prepared.in_features
        self.out_features = prepared.out_features
        self._hold(prepared)
        # a buffer, not a Parameter: loaders that fill every parameter leave quantized layers alone
        self.register_buffer("bias", bias.detach().clone() if bias is not None else None)

    @classmethod
    def from_float(
        cls,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        method: str | WeightMethod = "int8",
        device: torch.device | str | None = None,
    ) -> QuantLinear:
        """Quantize a float `[out, in]` weight."""
        m = get_weight_method(method)
        if weight.dim() != 2:
            raise QuantizationError(f"QuantLinear needs a 2-D weight, got shape {tuple(weight.shape)}")
        device = weight.device if device is None else device
        return cls(m, m.prepare(m.quantize(weight.detach()), device), bias)

    @classmethod
    def from_state(
        cls,
        state: dict[str, torch.Tensor],
        method: str | WeightMethod,
        bias: torch.Tensor | None = None,
        device: torch.device | str = "cpu",
    ) -> QuantLinear:
        """Build from a saved (portable) state, e.g. from `load_quantized_linear_state`."""
        m = get_weight_method(method)
        return cls(m, m.prepare(state, device), bias)

    def kernel_for(self, num_tokens: int) -> str:
        """The code path `forward` takes for `num_tokens` rows."""
        return self.method.kernel_for(self.prepared(), num_tokens)

    def _matmul(self, x2: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        if out is None:
            return self.method.apply(self.prepared(), x2)
        return self.method.apply_into(self.prepared(), x2, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = flatten_tokens(x, self.in_features)
        y = self._matmul(x2, None)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def forward_into(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`forward` for 2-D `x`, written into `out` (`[M, out_features]`)."""
        self._matmul(flatten_tokens(x, self.in_features), out)
        if self.bias is not None:
            out.add_(self.bias.to(out.dtype))
        return out

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, method={self.method!r}, kernel={self.kernel}"


def logits_fp32(head: nn.Module, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """`head(hidden)` in fp32, into `out` if given (`[rows, vocab]` fp32).

    A quantized head that quantizes its own input is fed fp32, so its epilogue writes fp32 logits at once:
    no rounding to the model dtype and no second vocabulary-wide copy (a noticeable share of a batched
    decode step)."""
    quantized = isinstance(head, QuantLinear)
    x = hidden.float() if quantized and head.method.quantizes_activations else hidden
    if out is None:
        return head(x).float()
    kernel_heads = (QuantLinear, GemvLinear, LosslessLinear)
    return head.forward_into(x, out) if isinstance(head, kernel_heads) else out.copy_(head(x))


class QuantEmbedding(nn.Module):
    """An embedding table stored in a method's portable state; looked-up rows are dequantized.

    Per-row scales (int8, fp8) and per-row groups (int4) make each row independent, so a lookup only
    touches the rows it returns.
    """

    def __init__(self, method: WeightMethod, state: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
        super().__init__()
        method.check_state(state)
        self.method = method
        self.dtype = dtype
        self._names = tuple(state)
        for name, tensor in state.items():
            self.register_buffer(name, tensor)
        self.num_embeddings = int(state[self._names[0]].shape[0])

    @classmethod
    def from_float(
        cls, weight: torch.Tensor, method: str | WeightMethod, dtype: torch.dtype | None = None
    ) -> QuantEmbedding:
        m = get_weight_method(method)
        return cls(m, m.quantize(weight.detach()), dtype or weight.dtype)

    def state(self) -> dict[str, torch.Tensor]:
        return {n: getattr(self, n) for n in self._names}

    def weight_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.state().values())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # checked eagerly only: reading the ids splits a compiled graph (extra graphs to enter every step),
        # and there the generated indexing asserts its bounds itself
        eager = not torch.compiler.is_compiling()
        if eager and ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_embeddings):
            raise QuantizationError(f"token id out of range [0, {self.num_embeddings})")
        return self.method.embedding_rows(self.state(), ids, self.dtype)

    def extra_repr(self) -> str:
        return f"num_embeddings={self.num_embeddings}, method={self.method!r}, dtype={self.dtype}"

"""Weight quantization methods: one ABC, one registry.

A method moves a weight through three forms:

- *float*: the `[..., out, in]` bf16/fp32 weight of a checkpoint (leading dims are stacked MoE experts);
- *state*: the portable tensors written to disk, named as compressed-tensors names them (`weight`,
  `weight_packed`, `weight_scale`, `weight_zero_point`, `weight_shape`);
- *prepared*: the runtime form a kernel wants (for int4 on CPU a machine-specific packed layout), never saved.

Quantization is row-wise (per output channel, or per group inside a row), so quantizing a fused
`[q; k; v]` weight equals concatenating the separately quantized parts; `concat` relies on that.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch


class QuantizationError(ValueError):
    """A weight, state or option that a quantization method cannot handle."""


@dataclass
class PreparedWeight:
    """Runtime tensors of one quantized weight, or of a stack of experts (leading dims).

    `kernel` names the code path `apply` takes (reported so tests and logs can check it).
    """

    kernel: str
    tensors: dict[str, torch.Tensor]
    out_features: int
    in_features: int

    def select(self, index: int) -> PreparedWeight:
        """The weight of one expert of a stacked (3-D) prepared weight."""
        return PreparedWeight(
            self.kernel, {k: v[index] for k, v in self.tensors.items()}, self.out_features, self.in_features
        )

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


class WeightMethod(ABC):
    """One way of storing and multiplying quantized weights.

    Subclasses implement the per-method parts; everything is row-wise over `[..., out, in]`.
    """

    name: ClassVar[str]
    #: compressed-tensors `format` of the checkpoint this method writes.
    checkpoint_format: ClassVar[str]
    #: `apply` quantizes its input itself, so an fp32 input costs nothing and gives fp32 output directly.
    quantizes_activations: ClassVar[bool] = False

    # --- float <-> state -------------------------------------------------------------------------
    @abstractmethod
    def quantize(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        """Quantize a float `[..., out, in]` weight into its portable state."""

    @abstractmethod
    def dequantize(self, state: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """Reference dequantization of a state back to `[..., out, in]` in `dtype`."""

    @abstractmethod
    def unpack(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """State -> row-major tensors whose dim -2 is `out` (used to concatenate fused weights)."""

    @abstractmethod
    def pack(self, unpacked: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Inverse of `unpack`."""

    # --- state -> runtime --------------------------------------------------------------------------
    @abstractmethod
    def prepare(self, state: dict[str, torch.Tensor], device: torch.device | str) -> PreparedWeight:
        """Runtime form on `device` (may repack for a kernel)."""

    @abstractmethod
    def apply(self, weight: PreparedWeight, x: torch.Tensor) -> torch.Tensor:
        """`x @ W.T` for one (non-stacked) weight: `x` is `[M, in]`, the result `[M, out]` in `x.dtype`."""

    def apply_into(self, weight: PreparedWeight, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`apply` writing into `out` (`[M, out]`, any float dtype): a caller's buffer reused across steps,
        so a large result's pages are not faulted in afresh each time. Methods whose kernel allocates
        its result copy it in."""
        return out.copy_(self.apply(weight, x))

    def gemv_form(self, weight: PreparedWeight) -> PreparedWeight | None:
        """The weight in the form our CPU GEMV kernels read (engine/kernels), or None where there is none.
        Called after `kernels.load()`."""
        return None

    @abstractmethod
    def kernel_for(self, weight: PreparedWeight, num_tokens: int) -> str:
        """Name of the code path `apply` takes for `num_tokens` rows (e.g. `int_mm` or `dequant`)."""

    @abstractmethod
    def embedding_rows(
        self, state: dict[str, torch.Tensor], ids: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        """Dequantize rows `ids` of a state (a quantized embedding table): `[*ids.shape, in]`."""

    # --- checkpoint description --------------------------------------------------------------------
    @abstractmethod
    def scheme(self) -> dict[str, Any]:
        """compressed-tensors config group (`weights`, `input_activations`, `format`)."""

    @abstractmethod
    def state_names(self) -> tuple[str, ...]:
        """Suffixes (after `prefix.`) of the tensors a state holds on disk."""

    def options(self) -> dict[str, Any]:
        """Constructor options, so `get_weight_method(m.name, **m.options())` rebuilds `m`."""
        return {}

    def concat(self, states: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """State of the row-wise concatenation of several weights (fused qkv, gate_up)."""
        parts = [self.unpack(s) for s in states]
        return self.pack({k: torch.cat([p[k] for p in parts], dim=-2) for k in parts[0]})

    def check_state(self, state: dict[str, torch.Tensor]) -> None:
        """Raise QuantizationError when a tensor the state needs is missing."""
        missing = [n for n in self.state_names() if n not in state]
        if missing:
            raise QuantizationError(f"{self.name} state lacks {', '.join(missing)}")

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v}" for k, v in self.options().items())
        return f"{type(self).__name__}({opts})"


_REGISTRY: dict[str, Callable[..., WeightMethod]] = {}


def register_weight_method(name: str) -> Callable[[type[WeightMethod]], type[WeightMethod]]:
    """Class decorator: make a method available as `get_weight_method(name)`."""

    def deco(cls: type[WeightMethod]) -> type[WeightMethod]:
        _REGISTRY[name] = cls
        return cls

    return deco


def get_weight_method(name: str | WeightMethod, **options: Any) -> WeightMethod:
    """The method registered as `name` (`int8`, `int4`, `fp8`), built with `options` (e.g. group_size)."""
    if isinstance(name, WeightMethod):
        return name
    # importing the modules registers the built-in methods
    from edgeinfer.engine.quant import fp8, int4, int8  # noqa: F401

    if name not in _REGISTRY:
        raise QuantizationError(
            f"unknown quantization method {name!r} (choose from {', '.join(weight_methods())})"
        )
    return _REGISTRY[name](**options)


def weight_methods() -> list[str]:
    """Names of the registered methods."""
    from edgeinfer.engine.quant import fp8, int4, int8  # noqa: F401

    return sorted(_REGISTRY)


def ct_args(**kw: Any) -> dict[str, Any]:
    """compressed-tensors `QuantizationArgs` as a dict, defaults filled in."""
    return {"group_size": None, "dynamic": False, "actorder": None, **kw}


# Weights quantized at once. Quantized whole, a stack of experts makes fp32 temporaries twice its own size
# (a dozen for each step of int4's grid search), and the kernel faults every one of them in afresh; in
# slices of this size they stay in the caches and their memory is reused.
CHUNK_ELEMS = 1 << 18


def row_chunks(rows: int, width: int) -> list[slice]:
    """Consecutive slices of `rows` rows of `width` values, about `CHUNK_ELEMS` values each (at least one
    row)."""
    step = max(1, CHUNK_ELEMS // max(1, width))
    return [slice(r, min(r + step, rows)) for r in range(0, rows, step)]


def flatten_tokens(x: torch.Tensor, in_features: int) -> torch.Tensor:
    """`[..., in]` -> contiguous `[M, in]`, with a clear error for the wrong width."""
    if x.shape[-1] != in_features:
        raise QuantizationError(f"input has {x.shape[-1]} features, the layer expects {in_features}")
    return x.reshape(-1, in_features)

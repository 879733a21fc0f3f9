"""Quantized checkpoints in the compressed-tensors layout: config, and the helpers the loader calls.

`config.json` gains a `quantization_config` (`quant_method: compressed-tensors`, one config group), and
each quantized module `M` stores `M.weight` (int8 / float8) + `M.weight_scale`, or for int4
`M.weight_packed`, `M.weight_scale`, `M.weight_zero_point`, `M.weight_shape`. Whether a module is quantized
is read from its tensors, not from name lists, so a loader needs no knowledge of what was skipped.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from edgeinfer.engine.quant.apply import set_submodule
from edgeinfer.engine.quant.base import QuantizationError, WeightMethod, get_weight_method
from edgeinfer.engine.quant.layers import QuantEmbedding, QuantLinear
from edgeinfer.engine.quant.packing import unpack_rows_int32

_QUANTIZED_DTYPES = (torch.int8, torch.float8_e4m3fn)


@dataclass(frozen=True)
class QuantizationConfig:
    """Which method a checkpoint was quantized with; `ignore` lists the float modules (informational)."""

    method: str
    group_size: int | None = None
    ignore: tuple[str, ...] = field(default_factory=tuple)

    def weight_method(self) -> WeightMethod:
        return get_weight_method(self.method, **({"group_size": self.group_size} if self.group_size else {}))

    def to_hf(self) -> dict[str, Any]:
        """The `quantization_config` entry of config.json."""
        scheme = self.weight_method().scheme()
        group = {"targets": ["Linear"], "output_activations": None, **scheme}
        return {
            "quant_method": "compressed-tensors",
            "format": scheme["format"],
            "quantization_status": "compressed",
            "config_groups": {"group_0": group},
            "ignore": list(self.ignore),
            "kv_cache_scheme": None,
        }

    @classmethod
    def from_hf(cls, hf_config: Mapping[str, Any]) -> QuantizationConfig | None:
        """Parse config.json's `quantization_config`; None when the checkpoint is not quantized."""
        qc = hf_config.get("quantization_config")
        if not qc:
            return None
        if qc.get("quant_method") != "compressed-tensors":
            raise QuantizationError(
                f"unsupported quant_method {qc.get('quant_method')!r} (compressed-tensors only)"
            )
        groups = list((qc.get("config_groups") or {}).values())
        if len(groups) != 1:
            raise QuantizationError(f"expected one quantization config group, found {len(groups)}")
        weights = groups[0].get("weights") or {}
        return cls(*_method_of(weights), ignore=tuple(qc.get("ignore") or ()))


def _method_of(weights: Mapping[str, Any]) -> tuple[str, int | None]:
    bits, kind, strategy = weights.get("num_bits"), weights.get("type"), weights.get("strategy")
    if bits == 8 and kind == "int" and strategy == "channel" and weights.get("symmetric", True):
        return "int8", None
    if bits == 8 and kind == "float" and strategy == "channel":
        return "fp8", None
    if bits == 4 and kind == "int" and strategy == "group":
        return "int4", int(weights["group_size"])
    raise QuantizationError(f"unsupported weight scheme: {bits}-bit {kind}, strategy {strategy}")


def load_quantized_linear_state(
    tensors: Mapping[str, torch.Tensor], prefix: str, method: WeightMethod
) -> dict[str, torch.Tensor] | None:
    """The saved state of module `prefix`, or None when that module is stored in float.

    int4 zero points become bf16 `[..., N, K/G]`: integer ones (4-bit, packed 8 rows to an int32, as
    compressed-tensors writes them by default) are unpacked, and symmetric checkpoints (no
    `weight_zero_point`, as GPTQ-style exports write them) get the implied 8. Raises QuantizationError for
    a partial or malformed state, naming the module.
    """
    if f"{prefix}.weight_g_idx" in tensors:
        raise QuantizationError(f"{prefix}: activation reordering (weight_g_idx) is not supported")
    if f"{prefix}.weight_scale" not in tensors:
        return None
    state = {n: tensors[f"{prefix}.{n}"] for n in method.state_names() if f"{prefix}.{n}" in tensors}
    if method.name == "int4" and "weight_packed" in state:
        _int4_float_zero_point(state)
    if method.name == "int4" and "weight_shape" not in state and "weight_packed" in state:
        words = state["weight_packed"]
        state["weight_shape"] = torch.tensor([words.shape[-2], words.shape[-1] * 8], dtype=torch.int32)
    try:
        method.check_state(state)
    except QuantizationError as e:
        raise QuantizationError(f"{prefix}: {e}") from None
    if "weight" in state and state["weight"].dtype not in _QUANTIZED_DTYPES:
        raise QuantizationError(
            f"{prefix}: weight has dtype {state['weight'].dtype}, not a {method.name} weight"
        )
    return state


def _int4_float_zero_point(state: dict[str, torch.Tensor]) -> None:
    """In place: the state's zero points as the bf16 `[..., N, K/G]` that `Int4Method` reads (its `unpack`
    checks the shape)."""
    zero = state.get("weight_zero_point")
    rows = state["weight_packed"].shape[-2]
    if zero is None:
        state["weight_zero_point"] = torch.full(state["weight_scale"].shape, 8.0, dtype=torch.bfloat16)
    elif zero.dtype == torch.int32 and zero.dim() >= 2 and zero.shape[-2] != rows:  # packed 8 rows a word
        state["weight_zero_point"] = unpack_rows_int32(zero, rows).to(torch.bfloat16)
    else:  # float, or integers one per group
        state["weight_zero_point"] = zero.to(torch.bfloat16)


def state_tensor_names(prefix: str, method: WeightMethod) -> list[str]:
    """Checkpoint names of module `prefix`'s quantized tensors."""
    return [f"{prefix}.{n}" for n in method.state_names()]


def apply_quantized_checkpoint(
    model: nn.Module,
    tensors: Mapping[str, torch.Tensor],
    config: QuantizationConfig,
    *,
    fused: Mapping[str, Sequence[str]] | None = None,
    aliases: Mapping[str, str] | None = None,
    device: torch.device | str = "cpu",
) -> set[str]:
    """Swap every `nn.Linear` / `nn.Embedding` whose checkpoint tensors are quantized for a quantized module.

    `fused` maps a fused module's last name to its checkpoint parts in row order
    (`{"qkv_proj": ["q_proj", "k_proj", "v_proj"]}`); their states and biases are concatenated.
    `aliases` maps a module name to the checkpoint prefix it reads (a tied lm_head -> `model.embed_tokens`);
    tied int8/fp8 modules then share one copy. Returns the checkpoint names consumed, so the caller loads
    the remaining (float) tensors the usual way.
    """
    method = config.weight_method()
    states: dict[tuple[str, ...], dict[str, torch.Tensor]] = {}
    consumed: set[str] = set()
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear | nn.Embedding):
            continue
        prefixes = _checkpoint_prefixes(name, fused or {}, aliases or {})
        if prefixes not in states:
            state = _load_parts(tensors, prefixes, method, name)
            if state is None:
                continue
            states[prefixes] = state
        for p in prefixes:
            consumed.update(n for n in (*state_tensor_names(p, method), f"{p}.bias") if n in tensors)
        biases = [tensors[f"{p}.bias"] for p in prefixes if f"{p}.bias" in tensors]
        bias = torch.cat(biases) if biases and isinstance(module, nn.Linear) else None
        set_submodule(model, name, _build(module, method, states[prefixes], bias, name, device))
    return consumed


def _checkpoint_prefixes(name: str, fused: Mapping[str, Sequence[str]], aliases: Mapping[str, str]) -> tuple:
    if name in aliases:
        return (aliases[name],)
    parent, _, last = name.rpartition(".")
    if last in fused:
        return tuple(f"{parent}.{part}" if parent else part for part in fused[last])
    return (name,)


def _load_parts(
    tensors: Mapping[str, torch.Tensor], prefixes: tuple[str, ...], method: WeightMethod, name: str
) -> dict[str, torch.Tensor] | None:
    parts = [load_quantized_linear_state(tensors, p, method) for p in prefixes]
    if all(p is None for p in parts):
        return None
    if any(p is None for p in parts):
        raise QuantizationError(f"{name}: only some of {', '.join(prefixes)} are quantized in the checkpoint")
    return parts[0] if len(parts) == 1 else method.concat(parts)  # type: ignore[arg-type]


def _build(
    module: nn.Module,
    method: WeightMethod,
    state: dict[str, torch.Tensor],
    bias: torch.Tensor | None,
    name: str,
    device: torch.device | str,
) -> nn.Module:
    if isinstance(module, nn.Embedding):
        return QuantEmbedding(method, {k: v.to(device) for k, v in state.items()}, module.weight.dtype)
    layer = QuantLinear.from_state(state, method, bias, device)
    if layer.out_features != module.out_features or layer.in_features != module.in_features:
        raise QuantizationError(
            f"{name}: checkpoint weight is {layer.out_features}x{layer.in_features}, "
            f"the model expects {module.out_features}x{module.in_features}"
        )
    return layer

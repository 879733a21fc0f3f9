"""Loading HF-named tensors into the MoE models.

Routed experts arrive either per expert (`…experts.{e}.gate_proj.weight` [I, H], as `save_pretrained`
writes them and as the released checkpoints ship) or fused (`…experts.gate_up_proj` [E, 2I, H] and
`…experts.down_proj` [E, H, I], transformers v5's in-memory layout); both land in our fused 3-D parameters.
Every `gate_proj` / `up_proj` fills the first / second half of the matching `gate_up_proj`.
Multi-token-prediction layers (`model.layers.{n ≥ num_layers}`, DeepSeek-V3 and GLM-4.5 ship one) are
skipped: the engine decodes one token per step, as HF does.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

import torch
from torch import nn

from edgeinfer.engine.model.weights import Shard

_EXPERT = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
_LAYER = re.compile(r"^model\.layers\.(?P<i>\d+)\.")
_HALVES = {"gate_proj": 0, "up_proj": 1}


def load_moe_weights(
    model: nn.Module,
    tensors: Iterable[tuple[str, torch.Tensor]],
    shards: list[Shard],
    num_layers: int,
    ignore: tuple[str, ...] = (),
    filled: Callable[[str], None] | None = None,
) -> None:
    """Copy every tensor into its parameter (slice); raise if a tensor has no home, or a parameter was
    not filled exactly once. `filled(name)` is called as each parameter receives its last values (it may
    replace the parameter: nothing here holds on to a filled one)."""
    params = {n: p.data for n, p in model.named_parameters()}  # a filled one: a meta tensor of its shape
    sizes = {n: p.numel() for n, p in params.items()}
    written = dict.fromkeys(params, 0)
    for name, tensor in tensors:
        if any(p in name for p in ignore) or _is_extra_layer(name, num_layers):
            continue
        target, dest = _destination(name, params, shards)
        if dest.shape != tensor.shape:
            raise ValueError(
                f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}"
            )
        dest.copy_(tensor)
        del dest
        written[target] += tensor.numel()
        if written[target] == sizes[target]:
            params[target] = params[target].to("meta")
            if filled is not None:
                filled(target)
    missing = [n for n in sizes if written[n] < sizes[n]]
    if missing:
        raise ValueError(f"checkpoint lacks tensors for {len(missing)} parameters, e.g. {missing[:3]}")
    repeated = [n for n in sizes if written[n] > sizes[n]]
    if repeated:
        raise ValueError(f"checkpoint fills {len(repeated)} parameters twice, e.g. {repeated[:3]}")


def _is_extra_layer(name: str, num_layers: int) -> bool:
    m = _LAYER.match(name)
    return m is not None and int(m["i"]) >= num_layers


def _destination(name: str, params: dict[str, torch.Tensor], shards: list[Shard]) -> tuple[str, torch.Tensor]:
    """The parameter a tensor belongs to and the view of it the tensor fills."""
    m = _EXPERT.match(name)
    if m:
        return _expert_destination(name, m, params)
    for shard in shards:
        token = f".{shard.part}."
        if token in name:
            target = name.replace(token, f".{shard.fused}.")
            return target, _unfilled(params, target, name).narrow(0, shard.start, shard.size)
    for part, half in _HALVES.items():
        token = f".{part}."
        if token in name:
            target = name.replace(token, ".gate_up_proj.")
            return target, _half(_unfilled(params, target, name), half)
    return name, _unfilled(params, name, name)


def _expert_destination(
    name: str, m: re.Match[str], params: dict[str, torch.Tensor]
) -> tuple[str, torch.Tensor]:
    proj, e = m["proj"], int(m["e"])
    target = f"{m['prefix']}.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}"
    param = _param(params, target, name)
    if e >= param.shape[0]:
        raise ValueError(f"checkpoint tensor {name!r} names expert {e}; the model has {param.shape[0]}")
    dest = _unfilled(params, target, name)[e]
    return target, dest if proj == "down_proj" else _half(dest, _HALVES[proj])


def _half(t: torch.Tensor, which: int) -> torch.Tensor:
    n = t.shape[0] // 2
    return t.narrow(0, which * n, n)


def _param(params: dict[str, torch.Tensor], target: str, name: str) -> torch.Tensor:
    try:
        return params[target]
    except KeyError:
        raise ValueError(f"checkpoint tensor {name!r} has no place in the model") from None


def _unfilled(params: dict[str, torch.Tensor], target: str, name: str) -> torch.Tensor:
    """The parameter `target` that tensor `name` goes to, unless it was filled already."""
    param = _param(params, target, name)
    if param.is_meta:
        raise ValueError(f"checkpoint tensor {name!r} fills parameter {target!r} twice")
    return param

"""Loading HF-named tensors into our modules, including shards of fused projections."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Shard:
    """HF weights named `*{part}.*` go to rows [start, start + size) of our fused `*{fused}.*`."""

    fused: str
    part: str
    start: int
    size: int


def load_weights(
    model: nn.Module,
    tensors: Iterable[tuple[str, torch.Tensor]],
    shards: list[Shard],
    ignore: tuple[str, ...] = (),
) -> None:
    """Copy every tensor into its parameter; raise if a tensor has no home or a parameter got nothing."""
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for name, tensor in tensors:
        if any(pattern in name for pattern in ignore):
            continue
        target, rows = _route(name, shards)
        if target not in params:
            raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
        param = params[target]
        dest = param.data if rows is None else param.data.narrow(0, rows[0], rows[1])
        if dest.shape != tensor.shape:
            raise ValueError(
                f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}"
            )
        dest.copy_(tensor)
        loaded.add(target)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")


def _route(name: str, shards: list[Shard]) -> tuple[str, tuple[int, int] | None]:
    for shard in shards:
        token = f".{shard.part}."
        if token in name:
            return name.replace(token, f".{shard.fused}."), (shard.start, shard.size)
    return name, None

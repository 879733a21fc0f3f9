"""Range clipping before weight quantization, searched on calibration inputs (AWQ's second step).

A group's grid spans its min..max, so one large weight coarsens the step for every other weight in the
group. Clamping the group to `ratio` times its range before quantizing trades that outlier's error for
finer steps elsewhere; the ratio is chosen per (row, group) to minimise the layer's output error on the
calibration inputs, `|| x_g @ (Q(clamp(w_g)) - w_g).T ||²` summed over rows, with `ratio = 1` (no clip)
among the candidates. The result is an ordinary float weight: any method then quantizes it as usual.
"""

from __future__ import annotations

import torch

from edgeinfer.engine.quant.base import WeightMethod

RATIOS = tuple(1.0 - 0.05 * i for i in range(10))  # 1.0 .. 0.55


def group_size(method: WeightMethod, in_features: int) -> int:
    """Inputs sharing one scale: the method's group, or the whole row for per-channel methods."""
    return int(method.options().get("group_size", in_features))


def clip_weight(
    method: WeightMethod, weight: torch.Tensor, x: torch.Tensor, ratios: tuple[float, ...] = RATIOS
) -> tuple[torch.Tensor, float]:
    """`weight` [N, K] clamped per (row, group) to the best ratio of its range for inputs `x` [n, K];
    also the fraction of (row, group) ranges that were narrowed."""
    k = weight.shape[-1]
    g = group_size(method, k)
    w = weight.float().unflatten(-1, (k // g, g))  # [N, groups, G]
    xg = x.float().unflatten(-1, (k // g, g))  # [n, groups, G]
    lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    best_err = torch.full(w.shape[:2], float("inf"))
    best = w
    for r in ratios:
        clamped = torch.maximum(torch.minimum(w, hi * r), lo * r)
        q = method.dequantize(method.quantize(clamped.flatten(-2)), torch.float32).unflatten(-1, (k // g, g))
        # output error of each (row, group) on every calibration row: [groups, n, N] -> summed over n
        err = torch.einsum("ngk,mgk->gnm", xg, q - w).square().sum(1).t()
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best = torch.where(better.unsqueeze(-1), clamped, best)
    narrowed = float((best != w).any(-1).float().mean())
    return best.flatten(-2), narrowed

"""GPTQ for group-wise int4: round one input column at a time and push each column's rounding error onto
the columns not yet rounded, weighted by the inverse Hessian of the layer's calibration inputs.

For a linear layer fed inputs `X`, the output error of a quantized weight `Q` is `tr((W - Q) H (W - Q)^T)`
with `H = X^T X`. Rounding to nearest minimises each weight's own error; GPTQ (Frantar et al., 2022)
instead lets later columns absorb earlier errors through correlated inputs. Columns go in order of
decreasing `diag(H)` (the inputs that carry the most energy are rounded first, while the most columns
are left to compensate). Each group's grid (scale, zero point) is fixed before any rounding, fitted to the
weight under the inputs' energies (`Int4Method.fit`): with columns out of order a group's grid cannot
follow the updated weight, and the fixed grid is exactly what the format stores.

`H` is damped by `DAMP` times its mean diagonal: calibration covers tens of thousands of tokens, fewer
than a 2048-input layer needs for a well-conditioned `H`; the damping keeps the updates from fitting the
calibration text (a smaller damping fits it and does worse on the eval text; docs/quantization.md).
"""

from __future__ import annotations

import torch

from edgeinfer.engine.quant.int4 import Int4Method

DAMP = 0.1
BLOCK = 128  # columns updated lazily together: the rest of the weight is touched once per block


def gptq_int4(
    method: Int4Method, weight: torch.Tensor, hessian: torch.Tensor, energy: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """The packed int4 state of `weight [N, K]` rounded by GPTQ under `hessian [K, K]`, on the group grids
    that `method.fit` gives for it under the inputs' `energy` (`[K]` mean squares)."""
    n, k = weight.shape
    g = method.group_size
    scale, zero = method.fit(weight.float().unflatten(-1, (k // g, g)), energy)  # [N, K/G] each
    w, hinv_u, order = _prepare(weight.float(), hessian.double())
    col_scale = scale.float().repeat_interleave(g, dim=1)[:, order]
    col_zero = zero.float().repeat_interleave(g, dim=1)[:, order]
    q = torch.empty(n, k, dtype=torch.uint8, device=weight.device)
    for a in range(0, k, BLOCK):
        b = min(a + BLOCK, k)
        block = w[:, a:b].clone()
        errors = torch.empty_like(block)
        hb = hinv_u[a:b, a:b]
        for i in range(b - a):
            col, s, z = block[:, i], col_scale[:, a + i], col_zero[:, a + i]
            code = torch.round(col / s + z).clamp_(0, 15)
            q[:, a + i] = code.to(torch.uint8)
            err = (col - (code - z) * s) / hb[i, i]
            block[:, i:].addr_(err, hb[i, i:], alpha=-1)
            errors[:, i] = err
        w[:, b:].addmm_(errors, hinv_u[a:b, b:], alpha=-1)
    codes = torch.empty_like(q)
    codes[:, order] = q
    return method.pack({"q": codes, "zero": zero, "scale": scale})


def _prepare(w: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weight with columns reordered, upper Cholesky factor of the damped inverse Hessian, the order)."""
    h = h.clone()
    dead = torch.diagonal(h) == 0  # inputs never active: their weights cannot matter, round them freely
    h[dead, dead] = 1.0
    order = torch.argsort(torch.diagonal(h), descending=True)
    h = h[order][:, order]
    h.diagonal().add_(DAMP * float(torch.diagonal(h).mean()))
    hinv = torch.cholesky_inverse(torch.linalg.cholesky(h))
    hinv_u = torch.linalg.cholesky(hinv, upper=True).float()
    return w[:, order].clone(), hinv_u, order

"""Mixture-of-experts feed-forward: a router picks `top_k` experts per token, the experts run grouped.

Execution groups tokens by expert: the `T × top_k` (token, expert) pairs are sorted by expert, each active
expert runs one gate-up and one down matmul over its contiguous slice of gathered tokens, and the results
are scattered back and summed with the routing weights. The loop is over active experts (at most
`num_experts`), never over tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from edgeinfer.engine.model.layers.activation import get_activation
from edgeinfer.engine.model.layers.mlp import GatedMLP
from edgeinfer.engine.model.routing import RouterSpec, TopKRouter


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
    `gate_up_proj` `[E, 2·I, H]` (gate rows first, then up) and `down_proj` `[E, H, I]`."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, act: str) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.intermediate = intermediate
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.act = get_activation(act)

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, H], expert_ids / weights [T, k] → Σ_j weights[t, j] · expert_{ids[t, j]}(x[t]), [T, H]."""
        num_tokens, top_k = expert_ids.shape
        flat = expert_ids.flatten()
        order = torch.argsort(flat, stable=True)  # pair rows grouped by expert, token order kept within
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        gathered = x[order // top_k]
        out = torch.empty_like(gathered)
        start = 0
        for expert, n in enumerate(counts):
            if n:
                out[start : start + n] = self._expert(expert, gathered[start : start + n])
                start += n
        pairs = torch.empty_like(out)
        pairs[order] = out  # back to (token, slot) order
        # Routing weights may be fp32 (sigmoid routers); HF multiplies in their dtype, then casts back.
        weighted = (pairs.view(num_tokens, top_k, -1) * weights.unsqueeze(-1)).to(x.dtype)
        return weighted.sum(dim=1)

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up_proj[e]).split(self.intermediate, dim=-1)
        return F.linear(self.act(gate) * up, self.down_proj[e])


class SparseMoeBlock(nn.Module):
    """Router + routed experts (+ shared experts). HF names: `gate`, `experts`, `shared_experts`."""

    def __init__(self, spec: MoeSpec) -> None:
        super().__init__()
        self.gate = TopKRouter(spec.router, spec.hidden)
        self.experts = FusedExperts(spec.router.num_experts, spec.hidden, spec.intermediate, spec.act)
        self.shared_experts = (
            GatedMLP(spec.hidden, spec.shared_intermediate, spec.act) if spec.shared_intermediate else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, expert_ids = self.gate(x)
        out = self.experts(x, expert_ids, weights)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out

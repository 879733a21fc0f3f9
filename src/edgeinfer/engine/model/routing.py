"""MoE routers: which `top_k` experts each token goes to, and with what weight.

Two scorings, as the HF reference implementations compute them:

- `softmax` (Qwen3-MoE): softmax over all expert logits (fp32), top-k, optionally renormalised.
- `sigmoid` with `noaux_tc` grouped selection (DeepSeek-V3, Kimi K2, GLM-4.5): sigmoid scores; the
  selection (not the weights) adds `e_score_correction_bias`; experts are split into `n_group` groups,
  a group scores the sum of its two best experts, only the `topk_group` best groups compete; the
  chosen experts' raw sigmoid scores are optionally renormalised, then scaled by `routed_scaling_factor`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

SCORINGS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class RouterSpec:
    num_experts: int
    top_k: int
    scoring: str  # one of SCORINGS
    norm_topk_prob: bool
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.scoring not in SCORINGS:
            raise ValueError(f"unknown router scoring {self.scoring!r} ({', '.join(SCORINGS)})")
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"top_k {self.top_k} must be in [1, num_experts={self.num_experts}]")


class TopKRouter(nn.Module):
    """`weight` [E, H] (HF: `mlp.gate.weight`); sigmoid routers also hold `e_score_correction_bias` [E].

    Sigmoid routers keep both in fp32 whatever the model dtype, as HF does (`_keep_in_fp32_modules`):
    the bias shifts near-tied scores, and bf16 would flip which expert wins.
    """

    def __init__(self, spec: RouterSpec, hidden: int) -> None:
        super().__init__()
        self.spec = spec
        fp32 = spec.scoring == "sigmoid"
        dtype = torch.float32 if fp32 else None
        self.weight = nn.Parameter(torch.empty(spec.num_experts, hidden, dtype=dtype))
        if fp32:
            self.e_score_correction_bias = nn.Parameter(torch.zeros(spec.num_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] → (weights [T, k], expert ids [T, k])."""
        if self.spec.scoring == "softmax":
            return self._softmax(x)
        return self._grouped_sigmoid(x)

    def _softmax(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.spec.top_k, dim=-1)
        if self.spec.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(logits.dtype), ids

    def _grouped_sigmoid(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.spec
        scores = F.linear(x.float(), self.weight).sigmoid()
        choice = scores + self.e_score_correction_bias
        if s.topk_group < s.n_group:
            choice = _keep_best_groups(choice, s.n_group, s.topk_group)
        ids = torch.topk(choice, s.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        if s.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * s.routed_scaling_factor, ids


def _keep_best_groups(choice: torch.Tensor, n_group: int, topk_group: int) -> torch.Tensor:
    """Mask (to -inf) every expert outside the `topk_group` groups whose two best scores sum highest."""
    grouped = choice.view(choice.shape[0], n_group, -1)
    group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
    best = torch.topk(group_scores, topk_group, dim=-1, sorted=False).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view_as(choice)

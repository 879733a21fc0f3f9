"""Routers and grouped expert execution against HF's own modules, at sizes the tiny models do not reach
(64 experts in 8 groups, top-6), and the grouping itself: one expert call per active expert."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import DeepseekV3Config, Qwen3MoeConfig
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts, Qwen3MoeTopKRouter

from edgeinfer.engine.model.moe import FusedExperts
from edgeinfer.engine.model.routing import RouterSpec, TopKRouter

HIDDEN, EXPERTS, TOP_K = 32, 64, 6


def _sorted(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """HF picks with `sorted=False`: compare each token's (id, weight) pairs ordered by id."""
    ids, order = ids.sort(dim=-1)
    return weights.gather(1, order), ids


@pytest.mark.parametrize(("topk_group", "norm"), [(3, True), (8, False), (1, True)])
def test_grouped_sigmoid_router_matches_deepseek_v3(topk_group, norm):
    cfg = DeepseekV3Config(
        hidden_size=HIDDEN,
        n_routed_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        n_group=8,
        topk_group=topk_group,
        norm_topk_prob=norm,
        routed_scaling_factor=2.5,
    )
    torch.manual_seed(0)
    hf = DeepseekV3TopkRouter(cfg)
    torch.nn.init.normal_(hf.weight, std=0.2)
    hf.e_score_correction_bias.normal_(std=0.3)  # large enough to change which experts win
    ours = TopKRouter(RouterSpec(EXPERTS, TOP_K, "sigmoid", norm, 8, topk_group, 2.5), HIDDEN)
    ours.load_state_dict({"weight": hf.weight, "e_score_correction_bias": hf.e_score_correction_bias})
    x = torch.randn(50, HIDDEN)
    _, hf_w, hf_ids = hf(x)
    w, ids = _sorted(*ours(x))
    ref_w, ref_ids = _sorted(hf_w, hf_ids)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w, ref_w, rtol=1e-6, atol=1e-7)
    if topk_group < 8:  # the chosen experts really lie in at most topk_group groups
        assert all(len(set((row // 8).tolist())) <= topk_group for row in ids)


@pytest.mark.parametrize("norm", [True, False])
def test_softmax_router_matches_qwen3_moe(norm):
    cfg = Qwen3MoeConfig(
        hidden_size=HIDDEN, num_experts=EXPERTS, num_experts_per_tok=TOP_K, norm_topk_prob=norm
    )
    torch.manual_seed(1)
    hf = Qwen3MoeTopKRouter(cfg)
    torch.nn.init.normal_(hf.weight, std=0.2)
    ours = TopKRouter(RouterSpec(EXPERTS, TOP_K, "softmax", norm), HIDDEN)
    ours.load_state_dict({"weight": hf.weight})
    x = torch.randn(50, HIDDEN)
    _, hf_w, hf_ids = hf(x)
    w, ids = ours(x)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(w, hf_w, rtol=1e-6, atol=1e-7)


def _experts(intermediate: int) -> tuple[FusedExperts, Qwen3MoeExperts]:
    cfg = Qwen3MoeConfig(hidden_size=HIDDEN, num_experts=EXPERTS, moe_intermediate_size=intermediate)
    hf = Qwen3MoeExperts(cfg)
    torch.manual_seed(2)
    torch.nn.init.normal_(hf.gate_up_proj, std=0.2)
    torch.nn.init.normal_(hf.down_proj, std=0.2)
    ours = FusedExperts(EXPERTS, HIDDEN, intermediate, "silu")
    ours.load_state_dict(hf.state_dict())
    return ours, hf


# 16 fp32 values = 64 bytes per row: the grouped GEMM; 18 = 72 bytes: the per-expert loop.
PATHS = pytest.mark.parametrize(
    ("intermediate", "grouped"), [(16, True), (18, False)], ids=["grouped_mm", "loop"]
)


@PATHS
def test_grouped_experts_match_hf_experts(intermediate, grouped):
    ours, hf = _experts(intermediate)
    assert ours.uses_grouped_mm == grouped
    x = torch.randn(40, HIDDEN)
    ids = torch.stack([torch.randperm(EXPERTS)[:TOP_K] for _ in range(40)])
    weights = torch.rand(40, TOP_K)
    torch.testing.assert_close(ours(x, ids, weights), hf(x, ids, weights), rtol=1e-5, atol=1e-6)


@PATHS
def test_experts_run_grouped_never_per_token(intermediate, grouped, monkeypatch):
    """Grouped GEMM: one call per projection whatever the batch. Loop: one matmul per active expert and
    projection, over all of that expert's tokens at once."""
    ours, _ = _experts(intermediate)
    calls: list[tuple[int, ...]] = []
    fn = "grouped_mm" if grouped else "linear"
    real = getattr(F, fn)

    def spy(x, w, **kw):
        calls.append(tuple(x.shape[:1]) + tuple(w.shape))
        return real(x, w, **kw)

    monkeypatch.setattr(F, fn, spy)
    ids = torch.tensor([[3, 7], [7, 1], [3, 1], [9, 3]])
    ours(torch.randn(4, HIDDEN), ids, torch.ones(4, 2))
    if grouped:
        assert [c[0] for c in calls] == [8, 8]  # all 8 (token, expert) rows in each of the two calls
    else:  # experts 1, 3, 7, 9 with 2, 3, 2, 1 tokens; gate-up for each, then down for each
        assert [c[0] for c in calls] == [2, 3, 2, 1, 2, 3, 2, 1]

"""Every MoE family against HF transformers on tiny random checkpoints, in fp32."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tiny_moe import FAMILIES
from transformers import AutoModelForCausalLM

from edgeinfer.engine.attention.backend import get_attention_backend
from edgeinfer.engine.attention.metadata import AttentionMetadata
from edgeinfer.engine.attention.mla import get_latent_attention
from edgeinfer.engine.attention.storage import KVCacheStorage
from edgeinfer.engine.loading import load_model
from edgeinfer.engine.model.loader import open_checkpoint
from edgeinfer.types import SamplingParams

PROMPTS = [[5, 17, 42, 99, 3, 250, 7, 8, 9, 10, 11], [300, 301, 5, 6]]
NEW_TOKENS = 40
MLA = ("deepseek_v3", "deepseek_v3_full_q")


@pytest.fixture(scope="module")
def hf_models(moe_models):
    return {
        f: AutoModelForCausalLM.from_pretrained(moe_models[f], dtype=torch.float32).eval() for f in FAMILIES
    }


@pytest.fixture(scope="module")
def hf_tokens(hf_models):
    """family → HF's greedy continuation of each prompt."""
    out = {}
    for family, model in hf_models.items():
        with torch.no_grad():
            runs = [
                model.generate(
                    torch.tensor([p]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False
                )
                for p in PROMPTS
            ]
        out[family] = [r[0, len(p) :].tolist() for r, p in zip(runs, PROMPTS, strict=True)]
    return out


GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=3)
CASES = [(f, "absorb") for f in FAMILIES] + [(f, "expand") for f in MLA]


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_and_logprobs_match_transformers(
    family, moe_models, hf_models, hf_tokens, engine_factory
):
    eng = engine_factory(moe_models[family])
    results = eng.generate(PROMPTS, GREEDY)
    for prompt, res, expected in zip(PROMPTS, results, hf_tokens[family], strict=True):
        assert res.token_ids == expected
        full = torch.tensor([prompt + res.token_ids])
        with torch.no_grad():
            ref = torch.log_softmax(hf_models[family](full).logits[0].float(), -1)
        ours = [lp for o in res.outputs for lp in o.logprobs]
        assert len(ours) == NEW_TOKENS
        for i, lp in enumerate(ours):
            assert abs(lp.logprob - ref[len(prompt) - 1 + i, lp.token_id].item()) < 1e-4


def paged_logits(model, ids: torch.Tensor, prefill: int) -> torch.Tensor:
    """Logits of `ids` through our paged path: one prefill chunk of `prefill` tokens, then one decode step
    per token, the sequence's cache scattered over out-of-order blocks."""
    storage = KVCacheStorage(model.kv_spec, 16, 4, torch.float32, torch.device("cpu"))
    backend = get_attention_backend("torch", storage)
    blocks = [9, 2, 14, 16, 5, 11, 3, 7]

    def meta(start: int, n: int) -> AttentionMetadata:
        slots = [blocks[p // 4] * 4 + p % 4 for p in range(start, start + n)]
        return AttentionMetadata(
            torch.tensor(slots), [0], [n], [start + n], torch.tensor([blocks]), int(n == 1), 4
        )

    outs = []
    with torch.no_grad():
        backend.begin(meta(0, prefill))
        outs.append(model.compute_logits(model(ids[:prefill], torch.arange(prefill), backend)))
        for p in range(prefill, len(ids)):
            backend.begin(meta(p, 1))
            outs.append(model.compute_logits(model(ids[p : p + 1], torch.tensor([p]), backend)))
    return torch.cat(outs)


IDS = torch.randint(3, 380, (24,), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize(("family", "mla_mode"), CASES)
def test_paged_logits_match_transformers_within_1e3(family, mla_mode, moe_models, hf_models):
    """Prefill a chunk, then decode token by token through scattered cache blocks: every step's logits
    equal HF's full-sequence logits within 1e-3."""
    model = load_model(open_checkpoint(moe_models[family]), torch.float32, torch.device("cpu"))
    model.set_latent_attention(get_latent_attention(mla_mode))
    with torch.no_grad():
        ref = hf_models[family](IDS[None]).logits[0]
    assert (paged_logits(model, IDS, 10) - ref).abs().max().item() < 1e-3


def test_sliding_window_qwen3_moe_matches_transformers(moe_models):
    """`use_sliding_window`: every layer sees the last 8 keys only (the 24-token sequence crosses it).
    The checkpoint has the same weights as `qwen3_moe`, which must then disagree with HF."""
    path = moe_models["qwen3_moe_sliding"]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(IDS[None]).logits[0]
    windowed = load_model(open_checkpoint(path), torch.float32, torch.device("cpu"))
    unwindowed = load_model(open_checkpoint(moe_models["qwen3_moe"]), torch.float32, torch.device("cpu"))
    assert (paged_logits(windowed, IDS, 10) - ref).abs().max().item() < 1e-3
    assert (paged_logits(unwindowed, IDS, 10) - ref).abs().max().item() > 1e-2


def test_fused_expert_keys_load_like_per_expert_keys(moe_models, hf_tokens, engine_factory):
    """A checkpoint with fused `experts.gate_up_proj` / `experts.down_proj` tensors runs the same model."""
    eng = engine_factory(moe_models["glm4_moe_fused"])
    results = eng.generate(PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    assert [r.token_ids for r in results] == hf_tokens["glm4_moe"]


def test_kimi_k2_config_runs_its_deepseek_v3_twin(moe_models, hf_models):
    """A config.json as Kimi K2 ships it (model_type kimi_k2, legacy `rope_theta` + `rope_scaling` YaRN,
    explicit scoring_func / topk_method) builds the same model as its DeepSeek-V3 twin."""
    kimi = load_model(open_checkpoint(moe_models["kimi_k2"]), torch.float32, torch.device("cpu"))
    twin = load_model(open_checkpoint(moe_models["deepseek_v3"]), torch.float32, torch.device("cpu"))
    assert dataclasses.replace(kimi.args, rope=twin.args.rope) == twin.args
    assert kimi.args.rope.items() >= twin.args.rope.items()  # legacy keys add `type`, change nothing
    with torch.no_grad():
        ref = hf_models["deepseek_v3"](IDS[None]).logits[0]
    assert (paged_logits(kimi, IDS, 10) - ref).abs().max().item() < 1e-3

"""MoE models on our kernels in bf16 and int4: the fused decode step takes them (GLM-4.5 and Qwen3-MoE with
GQA, DeepSeek-V3 and Kimi K2 with latent attention) and decodes as their eager path does, bit for bit; every
family's MoE layers run through our MoE block, and a sequence decodes alike alone or batched (bit for bit,
where the batch's prefill stays within the kernels' rows)."""

from __future__ import annotations

import pytest
from helpers.fused_step import assert_fused_step_decodes_as_eager, bf16_engine, greedy_answers
from helpers.kernels import require_gemv_kernels
from tiny_moe import make_tiny_moe

from edgeinfer.engine.model.moe import SparseMoeBlock

PROMPTS = [[3, 14, 15, 92, 65], list(range(4, 26)), [7] * 9, list(range(100, 140))]
MAX_TOKENS = 10
QUANTIZATION = pytest.mark.parametrize("quantization", [None, "int4"], ids=["bf16", "int4"])


@pytest.fixture(autouse=True)
def _kernels() -> None:
    require_gemv_kernels()


@pytest.fixture(scope="module")
def models(moe_models, tmp_path_factory) -> dict[str, str]:
    """The tiny MoE checkpoints, and a DeepSeek-V3 whose low-rank projections are 64 wide, as real ones'
    are multiples of: the int4 kernel's layout needs that of q_a_proj's and kv_a_proj's outputs."""
    path = tmp_path_factory.mktemp("mla") / "deepseek_v3_r64"
    r64 = make_tiny_moe("deepseek_v3", path, q_lora_rank=64, kv_lora_rank=48, qk_rope_head_dim=16)
    return moe_models | {"deepseek_v3_r64": str(r64)}


CASES = [(f, None) for f in ("glm4_moe", "qwen3_moe", "deepseek_v3", "deepseek_v3_full_q", "kimi_k2")] + [
    (f, "int4") for f in ("glm4_moe", "qwen3_moe", "deepseek_v3_r64")
]


@pytest.mark.parametrize(("family", "quantization"), CASES)
def test_the_fused_step_decodes_moe_models_as_the_eager_path(models, family, quantization) -> None:
    engine = bf16_engine(models[family], quantization=quantization)
    blocks = [m for m in engine.model.modules() if isinstance(m, SparseMoeBlock)]
    assert blocks and all(b.kernel_block is not None for b in blocks)
    assert_fused_step_decodes_as_eager(engine, PROMPTS, MAX_TOKENS)


def test_an_int8_kv_cache_keeps_gqa_moe_models_on_the_fused_step(models) -> None:
    """GQA layers attend over int8 codes in the step (kernels/kv_codes.h); MLA's latents stay bf16-only."""
    engine = bf16_engine(models["glm4_moe"], kv_cache_dtype="int8")
    assert_fused_step_decodes_as_eager(engine, PROMPTS, MAX_TOKENS)
    assert bf16_engine(models["deepseek_v3"], kv_cache_dtype="int8").runner.fused is None


@QUANTIZATION
@pytest.mark.parametrize("family", ["deepseek_v3_r64", "kimi_k2"])
def test_mla_moe_models_decode_alike_alone_and_batched(models, family, quantization) -> None:
    engine = bf16_engine(models[family], quantization=quantization)
    assert all(m.kernel_block is not None for m in engine.model.modules() if isinstance(m, SparseMoeBlock))
    # prompts whose joint prefill stays within the kernels' rows (wider products take torch's GEMM)
    prompts = PROMPTS[:3]
    alone, together = (greedy_answers(engine, prompts, MAX_TOKENS, t) for t in (False, True))
    assert alone == together

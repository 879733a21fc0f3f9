"""Our one-call MoE block (moe_block.cpp) against the torch form of the same SparseMoeBlock: each routing
(softmax, sigmoid with a correction bias, DeepSeek's group-limited), with and without a shared expert, bf16
and int4 experts; a token's output does not depend on what it is batched with; and experts in the lossless
form compute the bf16 block's bits, in both forms of the block."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers.kernels import require_gemv_kernels

from edgeinfer.engine.kernels.bf16 import use_bf16_gemv
from edgeinfer.engine.kernels.lossless import LosslessExperts, use_lossless
from edgeinfer.engine.model.moe import MoeSpec, SparseMoeBlock
from edgeinfer.engine.model.routing import RouterSpec
from edgeinfer.engine.quant.experts import QuantizedExperts
from edgeinfer.engine.quant.layers import PreparedModule
from edgeinfer.engine.runtime import runtime


@pytest.fixture(autouse=True)
def _kernels() -> None:
    require_gemv_kernels()


HIDDEN, INTERMEDIATE = 128, 64
ROUTERS = {
    "softmax": RouterSpec(16, 4, "softmax", norm_topk_prob=True),
    "sigmoid": RouterSpec(16, 4, "sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5),
    "grouped": RouterSpec(16, 3, "sigmoid", norm_topk_prob=True, n_group=4, topk_group=2),
}


def _block(router: str, shared: bool, seed: int = 0) -> SparseMoeBlock:
    spec = MoeSpec(HIDDEN, INTERMEDIATE, 2 * INTERMEDIATE if shared else 0, "silu", ROUTERS[router])
    torch.manual_seed(seed)
    block = SparseMoeBlock(spec)
    with torch.no_grad():
        for name, p in block.named_parameters():
            p.normal_(0, 0.1 if "bias" in name else 0.05)
    block = block.to(torch.bfloat16)
    if ROUTERS[router].scoring == "sigmoid":  # HF keeps sigmoid routers in fp32
        block.gate.float()
    # the shared expert's linears, as a bf16 model's load leaves them
    use_bf16_gemv(block)
    return block.eval().requires_grad_(False)


def _int4(block: SparseMoeBlock) -> SparseMoeBlock:
    from edgeinfer.engine.quant.apply import quantize_model
    from edgeinfer.engine.quant.base import get_weight_method

    quantize_model(block, get_weight_method("int4", group_size=32))
    for module in block.modules():
        if isinstance(module, PreparedModule):
            assert module.use_cpu_gemv()
    assert isinstance(block.experts.down_proj, QuantizedExperts)
    return block


@pytest.mark.parametrize("router", list(ROUTERS))
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("form", ["bf16", "int4"])
def test_the_kernel_block_computes_the_torch_block(router: str, shared: bool, form: str) -> None:
    block = _block(router, shared)
    if form == "int4":
        block = _int4(block)
    x = torch.randn(37, HIDDEN, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    expected = block(x)
    assert block.use_kernel(runtime().kernels)
    got = block(x)
    assert got.dtype == torch.bfloat16 and got.shape == expected.shape
    # the same experts chosen and the same roundings: outputs agree to a bf16 step or two
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)
    assert (got.float() - expected.float()).abs().mean() < 2e-3


@pytest.mark.parametrize("router", list(ROUTERS))
@pytest.mark.parametrize("form", ["bf16", "int4"])
def test_a_token_is_computed_alike_in_any_batch(router: str, form: str) -> None:
    """A lone token and a batch of 24 (several tokens to some experts, each expert's rows in blocks)
    give each token the same bits, bf16 and int4."""
    block = _block(router, shared=True, seed=1)
    if form == "int4":
        block = _int4(block)
    assert block.use_kernel(runtime().kernels)
    x = torch.randn(24, HIDDEN, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    together = block(x)
    alone = torch.cat([block(x[i : i + 1]) for i in range(len(x))])
    assert torch.equal(together, alone)


@pytest.mark.parametrize("router", list(ROUTERS))
def test_lossless_experts_compute_the_bf16_block(router: str) -> None:
    """The expert stacks (and the shared expert's linears) in the lossless form: the same bits as the bf16
    block, through torch (each stack decoded for the call) and through our block (each expert multiplied
    where it lies: lossless_gemv up to its rows limit, torch's GEMM on the decoded expert beyond), one token
    or 37 at a time."""
    plain = _block(router, shared=True, seed=2)
    packed = copy.deepcopy(plain)
    assert packed.experts.use_lossless() == 2 and use_lossless(packed) == 2
    assert isinstance(packed.experts.gate_up_proj, LosslessExperts)
    x = torch.randn(37, HIDDEN, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    assert torch.equal(packed(x), plain(x))
    assert plain.use_kernel(runtime().kernels) and packed.use_kernel(runtime().kernels)
    for rows in (x[:1], x[:5], x):
        assert torch.equal(packed(rows), plain(rows))

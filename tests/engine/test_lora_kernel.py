"""The segmented LoRA kernel (kernels/lora.cpp, `lora_add`) against a float64 reference and the torch ops
it replaces: random groups of contiguous and interleaved rows, several ranks, fused slices with columns no
adapter targets, empty groups, at every instruction-set level this CPU has."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from helpers.kernels import capped_isa

from edgeinfer.engine import kernels
from edgeinfer.engine.lora.config import AdapterConfig
from edgeinfer.engine.lora.step import StepPlan, plan_step, torch_delta
from edgeinfer.engine.lora.weights import LoraWeights, module_lora

KEY = (0, "qkv")
IN, OUT, TOKENS = 72, 100, 23  # tails past whole vectors of 16 and 32 inputs, and of 16 and 64 columns
# per adapter: rank, the output columns of each projection it targets (some columns none targets)
ADAPTERS = [
    (4, [(0, 40), (56, 100)]),
    (8, [(0, 100)]),
    (2, [(40, 56)]),
    (16, [(0, 40), (40, 56), (56, 100)]),
    (1, [(3, 4)]),
]
# per adapter: its rows of the flat batch (the base has the others)
ROWS = [
    [(2, 7)],  # contiguous, a tile of 4 and one of 1
    [(0, 1), (8, 9), (10, 12), (20, 21)],  # interleaved with others' rows
    [],  # a group with no token in this step
    [(1, 2), (7, 8), (12, 15), (16, 19), (21, 23)],  # tiles of 4, 4, 2 tokens
    [(9, 10)],
]


@pytest.fixture(scope="module")
def ops():
    try:
        kernels.load()
    except kernels.KernelBuildError as e:
        pytest.skip(f"the CPU kernels cannot be built here: {e}")
    return torch.ops.edgeinfer_cpu


@pytest.fixture(params=["scalar", "avx512", "avx512_bf16"])
def level(request, ops) -> Iterator[str]:
    """Each variant in turn (each only where the CPU has it)."""
    yield from capped_isa(ops, request.param)


SCALE = 0.5
Projection = tuple[int, int, torch.Tensor, torch.Tensor]  # lo, hi, PEFT's A [r, in] and B [hi - lo, r]


def _projections(i: int, rank: int, columns: list[tuple[int, int]]) -> list[Projection]:
    g = torch.Generator().manual_seed(i)
    return [
        (lo, hi, torch.randn(rank, IN, generator=g), torch.randn(hi - lo, rank, generator=g))
        for lo, hi in columns
    ]


def _step(dtype: torch.dtype, rows: list[list[tuple[int, int]]] = ROWS) -> StepPlan:
    groups = []
    for i, ((rank, columns), ranges) in enumerate(zip(ADAPTERS, rows, strict=True)):
        lora = module_lora(_projections(i, rank, columns), SCALE, dtype)
        config = AdapterConfig(rank, 1.0, False, frozenset(), None)
        groups.append((LoraWeights(f"a{i}", config, "", {KEY: lora}, 0), ranges))
    return plan_step(groups)


def _inputs(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(99)
    return torch.randn(TOKENS, IN, generator=g).to(dtype), (4 * torch.randn(TOKENS, OUT, generator=g)).to(
        dtype
    )


def _kernel(ops, plan: StepPlan, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    got = out.clone()
    step = plan.modules[KEY]
    ops.lora_add(got, x, plan.rows, step.a, step.b, step.plan)
    return got


def _exact_delta(x: torch.Tensor) -> torch.Tensor:
    """The deltas in float64 from PEFT's A and B (rounded to x's dtype, as the layout rounds them)."""
    delta = torch.zeros(TOKENS, OUT, dtype=torch.float64)
    for i, ((rank, columns), ranges) in enumerate(zip(ADAPTERS, ROWS, strict=True)):
        for lo, hi, a, b in _projections(i, rank, columns):
            a, b = a.to(x.dtype).double(), (b * SCALE).to(x.dtype).double()
            for start, end in ranges:
                delta[start:end, lo:hi] += x[start:end].double() @ a.T @ b.T
    return delta


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_add_matches_a_float64_reference_at_every_level(ops, level, dtype):
    plan = _step(dtype)
    x, out = _inputs(dtype)
    got = _kernel(ops, plan, x, out)
    exact = out.double() + _exact_delta(x)
    if dtype == torch.float32:
        assert torch.allclose(got.double(), exact, rtol=1e-5, atol=1e-4)
    else:  # fp32 sums rounded once into bf16: within one bf16 rounding of the exact sum, and a little more
        assert ((got.double() - exact).abs() <= exact.abs() * 2.0**-8 + 1e-2).all()
    touched = torch.zeros(TOKENS, OUT, dtype=torch.bool)
    for rank_cols, ranges in zip(ADAPTERS, ROWS, strict=True):
        for lo, hi in ranges:
            for c0, c1 in rank_cols[1]:
                touched[lo:hi, c0:c1] = True
    assert torch.equal(got[~touched], out[~touched])  # the base's rows, untargeted columns: as they were


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_add_matches_the_torch_ops(ops, dtype):
    plan = _step(dtype)
    x, out = _inputs(dtype)
    ref = out.clone()
    torch_delta(ref, x, plan.rows, plan.modules[KEY])
    got = _kernel(ops, plan, x, out)
    assert torch.equal(_kernel(ops, plan, x.T.contiguous().T, out), got)  # x read as it lies or copied
    if dtype == torch.float32:
        assert torch.allclose(got, ref, rtol=1e-5, atol=1e-4)
    else:  # torch rounds h and each delta to bf16 too
        assert torch.allclose(got.float(), ref.float(), rtol=2e-2, atol=0.5)


def test_a_tokens_delta_does_not_depend_on_its_batch(ops, level):
    """Each token alone in its group gets the bits it gets in the mixed batch (a tile of 1 token, not 4)."""
    plan = _step(torch.bfloat16)
    x, out = _inputs(torch.bfloat16)
    together = _kernel(ops, plan, x, out)
    for i, ranges in enumerate(ROWS):
        for lo, hi in ranges:
            for row in range(lo, hi):
                alone = [[(row, row + 1)] if j == i else [] for j in range(len(ROWS))]
                got = _kernel(ops, _step(torch.bfloat16, alone), x, out)
                assert torch.equal(got[row], together[row])


def test_lora_add_refuses_a_plan_that_leaves_its_tensors(ops):
    plan = _step(torch.float32)
    x, out = _inputs(torch.float32)
    step = plan.modules[KEY]
    bad = step.plan.clone()
    bad[1] = plan.rows.numel() + 1  # the first group's segment past the rows
    with pytest.raises(RuntimeError, match="a segment leaves rows"):
        ops.lora_add(out, x, plan.rows, step.a, step.b, bad)
    with pytest.raises(RuntimeError, match="a slice leaves out"):
        ops.lora_add(out[:, :50], x, plan.rows, step.a, step.b, step.plan)
    with pytest.raises(RuntimeError, match="a row leaves x"):
        ops.lora_add(out, x, plan.rows + TOKENS, step.a, step.b, step.plan)
    with pytest.raises(RuntimeError, match="of one dtype"):
        ops.lora_add(out.bfloat16(), x, plan.rows, step.a, step.b, step.plan)

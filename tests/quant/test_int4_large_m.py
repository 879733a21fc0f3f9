"""int4 on CPU with many rows: the packed weight is dequantized to `[K, N]` and multiplied in one GEMM.

The fused kernel computes `(q - 8) * scale + zero` in fp32 and accumulates in fp32; the large-M path
rounds that weight to the activations' dtype first. Both are compared against an fp32 product with the
kernel's exact weight: they may differ from it by the bf16 rounding of the weight and of the output.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from edgeinfer.engine.quant import QuantLinear, get_weight_method
from edgeinfer.engine.quant import int4 as int4_mod
from edgeinfer.engine.runtime import runtime

LARGE_M = int4_mod._DEQUANT_MIN_TOKENS


def kernel_weight(w: torch.Tensor, group: int) -> torch.Tensor:
    """The fp32 weight the fused CPU kernel multiplies by (its zero term rounded to bf16)."""
    m = get_weight_method("int4", group_size=group)
    u = m.unpack(m.quantize(w))
    scale = u["scale"].float()
    zero = ((8 - u["zero"].float()) * scale).to(torch.bfloat16).float()
    q = u["q"].float().unflatten(-1, (-1, group))
    return ((q - 8) * scale.unsqueeze(-1) + zero.unsqueeze(-1)).flatten(-2)


def assert_close_to(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    ref = x.float() @ w.T
    # weight rounded to bf16 (2^-9 relative) plus the output's rounding
    bound = (x.float().abs() @ w.abs().T) * 2**-8 + ref.abs() * 2**-8 + 1e-6
    assert torch.all((y.float() - ref).abs() <= bound)


def make_layer(out: int, inp: int, group: int = 128, seed: int = 0) -> tuple[QuantLinear, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inp, generator=g) * 0.05
    w[3] = w[3].abs() + 0.01  # an all-positive row: its zero point is 0
    layer = QuantLinear.from_float(w, None, get_weight_method("int4", group_size=group))
    return layer, kernel_weight(w, group)


def test_packing_layout_is_recognised():
    assert runtime().int4_pack is not None


@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_large_m_matches_fused_kernel(group, dtype):
    layer, w = make_layer(192, 256, group)
    x = torch.randn(LARGE_M + 5, 256, generator=torch.Generator().manual_seed(1)).to(dtype)
    assert layer.kernel_for(x.shape[0]) == "dequant"
    assert layer.kernel_for(LARGE_M - 1) == "cpu_int4pack"
    y = layer(x)
    assert y.dtype == dtype and y.shape == (x.shape[0], 192)
    assert_close_to(y, x, w)
    # the same rows one at a time go through the fused kernel
    fused = torch.cat([layer(x[i : i + 1]) for i in range(x.shape[0])])
    assert_close_to(fused, x, w)


def test_rows_not_a_multiple_of_the_packing_block_keep_the_fused_kernel():
    layer, w = make_layer(48, 128)  # 48 % 16 == 0 (kernel OK) but not a whole block of the packing
    x = torch.randn(LARGE_M, 128, dtype=torch.bfloat16)
    assert layer.kernel_for(LARGE_M) == "cpu_int4pack"
    assert_close_to(layer(x), x, w)


# fp32 activations: both paths use the exact fp32 weight, so they differ only in summation order
_OTHER_CPU_SCRIPT = """
import torch
from edgeinfer.engine.quant import QuantLinear, int4
from edgeinfer.engine.runtime import runtime
assert runtime().int4_pack is not None, "packing not recognised"
layer = QuantLinear.from_float(torch.randn(128, 256) * 0.05, None, "int4")
x = torch.randn(int4._DEQUANT_MIN_TOKENS, 256)
assert layer.kernel_for(x.shape[0]) == "dequant"
rows = torch.cat([layer(r) for r in x.split(1)])
assert torch.allclose(layer(x), rows, rtol=1e-4, atol=1e-5)
"""


@pytest.mark.parametrize("capability", ["avx2", "default"])
def test_packing_of_other_vector_widths(capability):
    """The packing differs per CPU capability; torch can be told to use a narrower one."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("needs an x86 CPU with AVX2")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability, "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-c", _OTHER_CPU_SCRIPT], env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]

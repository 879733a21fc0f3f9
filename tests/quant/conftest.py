"""Fixtures of the CPU kernel tests."""

from __future__ import annotations

import pytest
import torch

from edgeinfer.engine.quant import kernels


@pytest.fixture(scope="module")
def ops():
    """`torch.ops.edgeinfer_cpu`, built here; the test skips where the kernels cannot be built."""
    try:
        kernels.load()
    except kernels.KernelBuildError as e:  # no compiler, or not x86
        pytest.skip(f"the CPU kernels cannot be built here: {e}")
    return torch.ops.edgeinfer_cpu

"""Fixtures of the CPU kernel tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from helpers.kernels import capped_isa

from edgeinfer.engine import kernels


@pytest.fixture(scope="module")
def ops():
    """`torch.ops.edgeinfer_cpu`, built here; the test skips where the kernels cannot be built."""
    try:
        kernels.load()
    except kernels.KernelBuildError as e:  # no compiler, or not x86
        pytest.skip(f"the CPU kernels cannot be built here: {e}")
    return torch.ops.edgeinfer_cpu


# The ops' variants: plain loops, AVX2 and AVX-512.
LEVELS = ("scalar", "avx2", "avx512")


@pytest.fixture(params=LEVELS)
def level(request, ops) -> Iterator[str]:
    """Each variant in turn (each only where the CPU has it)."""
    yield from capped_isa(ops, request.param)

"""Skips for tests of our CPU kernels, with the reason, where this machine cannot build or run them."""

from __future__ import annotations

import pytest

from edgeinfer.engine import kernels


def require_gemv_kernels() -> None:
    """The int8/int4 GEMV kernels need AVX2 (VNNI where present) and a C++ compiler that builds them."""
    if not kernels.cpu_has_avx2():
        pytest.skip("the int8/int4 GEMV kernels need an x86 CPU with AVX2")
    try:
        kernels.load()
    except kernels.KernelBuildError as e:  # no C++ compiler, or one that cannot target these ISAs
        pytest.skip(f"the CPU kernels cannot be built here: {e}")

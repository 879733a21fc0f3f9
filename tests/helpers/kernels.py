"""Skips for tests of our CPU kernels, with the reason, where this machine cannot build or run them."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

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


def capped_isa(ops: Any, level: str) -> Iterator[str]:
    """For a fixture: the kernels held to one ISA variant for a test (skipped where the CPU lacks it),
    then given every variant back."""
    ops.set_isa_cap(level)
    try:
        if ops.isa() != level:
            pytest.skip(f"no {level} here")
        yield level
    finally:
        ops.set_isa_cap(kernels.ISA_LEVELS[-1])

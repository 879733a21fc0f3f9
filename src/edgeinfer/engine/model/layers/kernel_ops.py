"""When a layer hands its bf16 norms, rotations and activations to our CPU kernels (decode_ops.cpp).

The kernels remove the cost of calling a dozen torch ops, which is what a decode step's norms, rotations
and activations mostly cost. Past a few thousand values the arithmetic dominates: there the kernels' AVX-512
loops (parallel across rows) run at least as fast as torch's elementwise kernels, their plain loops (CPUs
without AVX-512) do not, and slow a prefill down when they take every size. So with AVX-512 every input
takes them (a batched decode step gains and a prefill step loses nothing), else only inputs up to 16,384
values: a decode step of a few sequences (Gemma's q-norm at one sequence: 1,024).
"""

from __future__ import annotations

import torch
from torch import nn

from edgeinfer.engine.kernels import AVX512_FLAGS, cpu_flags

EVERY_INPUT = 2**62  # no limit


def _max_elements(flags: frozenset[str]) -> int:
    """Inputs of up to this many values take the kernels (module docstring)."""
    return EVERY_INPUT if flags >= AVX512_FLAGS else 16_384


MAX_ELEMENTS = _max_elements(cpu_flags())


def takes_kernel(module: nn.Module, x: torch.Tensor) -> bool:
    """Whether `module` (switched on by `model.decode_ops.use_decode_ops`) runs `x` through our kernel; a
    compiled graph keeps the torch ops, which inductor fuses itself."""
    return (
        getattr(module, "kernel", False)
        and x.dtype == torch.bfloat16
        and x.numel() <= MAX_ELEMENTS
        and not torch.compiler.is_compiling()
    )

"""Which products and ops take our kernels on this CPU: decided once, from its feature flags.

bf16 products (bf16.py): on AVX-512 CPUs with AVX512-BF16 and no AMX, products of up to 64 rows (every
decode step of up to `max_num_seqs` = 64 sequences) take the register tiles of bf16_tiles.cpp, whose
weight stream keeps the memory bandwidth where torch's GEMM does not; wider products (prefill) are bound by
arithmetic and keep torch's GEMM. With AMX, oneDNN's AMX GEMM overtakes the kernel's loops from 4 rows, so
up to 2; AVX-512 without BF16 (weights widened to fp32): up to 16. AVX2 only: up to 64 again, since oneDNN
has no bf16 code for such a CPU (short of AVX-NE-CONVERT) and torch's GEMM there is slower than the
kernel (two activation rows a pass) at every decode size; it also keeps a token's bits independent of how
many share its step.

Norms, rotations and activations (decode_ops.cpp): the kernels remove the cost of calling a dozen torch ops,
which is what a decode step's small ops mostly cost. Past a few thousand values the arithmetic dominates:
there the AVX-512 loops (parallel across rows) run at least as fast as torch's elementwise kernels, the
plain loops (CPUs without AVX-512) do not and slow a prefill down, so without AVX-512 only inputs up to
16,384 values take them: a decode step of a few sequences.
"""

from __future__ import annotations

from dataclasses import dataclass

EVERY_INPUT = 2**62  # no limit
# What isa.h's AVX-512 level needs (the base set every AVX-512 kernel targets).
AVX512_FLAGS = frozenset({"avx512f", "avx512bw", "avx512vl"})


@dataclass(frozen=True, kw_only=True)
class KernelLimits:
    """Products of up to `bf16_gemv_rows` rows take `bf16_gemv`; inputs of up to `decode_op_elements`
    values take the one-call norms, rotations and activations."""

    bf16_gemv_rows: int
    decode_op_elements: int

    @classmethod
    def for_flags(cls, flags: frozenset[str]) -> KernelLimits:
        """The limits on a CPU with these /proc/cpuinfo flags (module docstring)."""
        avx512 = flags >= AVX512_FLAGS
        if "amx_bf16" in flags:
            rows = 2
        elif avx512 and "avx512_bf16" not in flags:
            rows = 16
        else:
            rows = 64
        return cls(bf16_gemv_rows=rows, decode_op_elements=EVERY_INPUT if avx512 else 16_384)

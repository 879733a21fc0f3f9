"""`--dtype auto` for encoders: bf16 only where the CPU multiplies bf16 in hardware."""

from __future__ import annotations

import torch

from edgeinfer.engine import kernels
from edgeinfer.engine.embedding.embedder import encoder_dtype

CPU = torch.device("cpu")


def test_auto_is_bf16_only_with_bf16_hardware():
    expected = torch.bfloat16 if kernels.cpu_has_bf16_matmul() else torch.float32
    assert encoder_dtype("auto", CPU) == expected


def test_an_explicit_dtype_is_kept():
    assert encoder_dtype("bfloat16", CPU) == torch.bfloat16
    assert encoder_dtype("float32", CPU) == torch.float32

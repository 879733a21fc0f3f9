"""Our one-call decode ops (decode_ops.cpp) switched on for a model and its attention backend.

A one-sequence decode step of a small model costs more in calling ops than in their arithmetic. With
the ops on, each RMSNorm of bf16 rows is one call instead of ~6, and each attention layer of a
one-sequence step over a plain bf16 cache is one call (write K/V, attend over the blocks in place)
instead of ~15 with the gather. Only models whose layers already run on our kernels take them (the
engine decides: `loading.uses_cpu_gemv`), so `cpu_gemv=False` keeps the whole step on torch's ops.
"""

from __future__ import annotations

from torch import nn

from edgeinfer.engine.attention import AttentionBackend
from edgeinfer.engine.attention.torch_backend import TorchPagedBackend
from edgeinfer.engine.model.layers.norm import RMSNorm


def use_decode_ops(model: nn.Module, backend: AttentionBackend) -> int:
    """Turn the ops on for the model's RMSNorms and, if it is ours, the backend (call after
    `kernels.load()`); returns how many modules switched."""
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    for norm in norms:
        norm.kernel = True
    if isinstance(backend, TorchPagedBackend):
        backend.decode_ops = True
    return len(norms)

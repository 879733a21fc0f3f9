"""Sentence pooling over a packed batch of hidden states, as sentence-transformers' Pooling module."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

POOLING_MODES = ("mean", "cls", "lasttoken", "max")


def pool(hidden: torch.Tensor, lengths: Sequence[int], mode: str, normalize: bool) -> torch.Tensor:
    """`hidden` [T, d] holds sequences of `lengths` back to back; one fp32 vector per sequence, [n, d]."""
    if mode not in POOLING_MODES:
        raise ValueError(f"pooling mode {mode!r} (one of {', '.join(POOLING_MODES)})")
    # Pool in fp32: sums over hundreds of bf16 rows would lose the precision the reference keeps.
    hidden = hidden.float()
    counts = torch.tensor(lengths, device=hidden.device)
    ends = torch.cumsum(counts, 0)
    if mode == "cls":
        out = hidden[ends - counts]
    elif mode == "lasttoken":
        out = hidden[ends - 1]
    elif mode == "max":
        out = torch.segment_reduce(hidden, "max", lengths=counts, axis=0)
    else:
        out = torch.segment_reduce(hidden, "sum", lengths=counts, axis=0) / counts[:, None].float()
    return F.normalize(out, dim=-1) if normalize else out

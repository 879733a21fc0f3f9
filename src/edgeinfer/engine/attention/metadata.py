"""Per-step attention metadata, built once by the runner and shared by every layer."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    """Where this step's tokens sit in the flat batch and in the paged cache.

    Sequences are ordered decodes first (one query token each), then prefill chunks, so the decode
    rows form one contiguous slice `[:num_decodes]` of the flat token batch.
    """

    slot_mapping: torch.Tensor  # [T] flat cache slot of each new token
    query_starts: list[int]  # per sequence: first row in the flat batch
    query_lens: list[int]
    context_lens: list[int]  # per sequence: tokens in cache after this step (prior + new)
    block_tables: torch.Tensor  # [B, max_blocks] block ids, padded with the null block (0)
    num_decodes: int
    block_size: int
    # Scratch for backends: masks and gather indices are the same for every layer of a step.
    cache: dict[object, object] = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

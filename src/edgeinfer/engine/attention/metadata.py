"""Per-step attention metadata, built once by the runner and shared by every layer."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    """Where this step's tokens sit in the flat batch and in the paged cache.

    Sequences are ordered decodes first (one query token each), then prefill chunks, so the decode
    rows form one contiguous slice `[:num_decodes]` of the flat token batch.

    With several KV groups (kv_cache/groups.py) each has its own slots and tables, stacked on a leading
    group dimension; a layer reads its group's (`group_slots`, `group_tables`).
    """

    slot_mapping: torch.Tensor  # [T] flat cache slot of each new token ([G, T] with G groups)
    query_starts: list[int]  # per sequence: first row in the flat batch
    query_lens: list[int]
    context_lens: list[int]  # per sequence: tokens in cache after this step (prior + new)
    # [B, max_blocks] block ids ([G, B, max_blocks] with G groups), padded with the null block (0)
    block_tables: torch.Tensor
    num_decodes: int
    block_size: int
    # Scratch for backends: masks and gather indices are the same for every layer of a step.
    cache: dict[object, object] = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    def group_slots(self, group: int) -> torch.Tensor:
        return self.slot_mapping if self.slot_mapping.dim() == 1 else self.slot_mapping[group]

    def group_tables(self, group: int) -> torch.Tensor:
        return self.block_tables if self.block_tables.dim() == 2 else self.block_tables[group]

    def decode_context_lens(self, device: torch.device) -> torch.Tensor:
        """The decodes' context lengths, int64 [num_decodes]. Inside a compiled graph (the one-sequence
        decode step, model/compile.py) one `full` per length: AOTAutograd's cache refuses to store a graph
        with a `torch.tensor` call in it, and every start would run AOTAutograd on it again."""
        lens = self.context_lens[: self.num_decodes]
        if torch.compiler.is_compiling():
            return torch.cat([torch.full((1,), n, dtype=torch.long, device=device) for n in lens])
        return torch.tensor(lens, dtype=torch.long, device=device)

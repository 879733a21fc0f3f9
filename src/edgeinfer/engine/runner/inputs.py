"""Flat-batch model inputs for one step."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from edgeinfer.engine.attention.metadata import AttentionMetadata
from edgeinfer.engine.kv_cache import NULL_BLOCK
from edgeinfer.engine.scheduler import ScheduledChunk


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    attn: AttentionMetadata
    chunks: list[ScheduledChunk]  # in flat-batch order (decodes first)
    sample_rows: list[int]  # flat row of the last token of each sampling chunk
    sample_chunks: list[ScheduledChunk]
    prompt_logprob_rows: dict[str, list[int]]  # request id → rows whose logits score prompt tokens


def build_inputs(chunks: list[ScheduledChunk], block_size: int, device: torch.device) -> StepInputs:
    ordered = sorted(chunks, key=lambda c: c.num_tokens > 1)  # decodes first, stable
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    starts, lens, ctx = [], [], []
    sample_rows, sample_chunks = [], []
    plp_rows: dict[str, list[int]] = {}
    for c in ordered:
        row0 = len(ids)
        ids.extend(c.token_ids)
        positions = range(c.start, c.start + c.num_tokens)
        pos.extend(positions)
        slots.extend(c.block_ids[p // block_size] * block_size + p % block_size for p in positions)
        starts.append(row0)
        lens.append(c.num_tokens)
        ctx.append(c.start + c.num_tokens)
        if c.sample:
            sample_rows.append(len(ids) - 1)
            sample_chunks.append(c)
        if c.sampling.prompt_logprobs is not None:
            last = min(c.start + c.num_tokens, c.num_prompt_tokens - 1)  # row p scores prompt token p + 1
            plp_rows[c.request_id] = list(range(row0, row0 + max(0, last - c.start)))
    width = max(len(c.block_ids) for c in ordered)
    # Padding points at the null block, which no sequence writes: a padded read never sees another's K/V.
    tables = torch.full((len(ordered), width), NULL_BLOCK, dtype=torch.long)
    for i, c in enumerate(ordered):
        tables[i, : len(c.block_ids)] = torch.tensor(c.block_ids, dtype=torch.long)
    attn = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        query_starts=starts,
        query_lens=lens,
        context_lens=ctx,
        block_tables=tables.to(device),
        num_decodes=sum(1 for n in lens if n == 1),
        block_size=block_size,
    )
    return StepInputs(
        input_ids=torch.tensor(ids, dtype=torch.long, device=device),
        positions=torch.tensor(pos, dtype=torch.long, device=device),
        attn=attn,
        chunks=ordered,
        sample_rows=sample_rows,
        sample_chunks=sample_chunks,
        prompt_logprob_rows=plp_rows,
    )

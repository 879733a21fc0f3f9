"""Flat-batch model inputs for one step."""

from __future__ import annotations

import dataclasses
from array import array
from dataclasses import dataclass

import torch

from edgeinfer.engine.attention.metadata import AttentionMetadata
from edgeinfer.engine.kv_cache import NULL_BLOCK
from edgeinfer.engine.scheduler import ScheduledChunk


@dataclass
class SampleGroup:
    """The sample rows of one chunk: `sample_rows[first : first + size]`, one row, or for a chunk that
    verifies drafts one row per token it computes (its last token's and each draft's)."""

    chunk: ScheduledChunk
    first: int
    size: int


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    attn: AttentionMetadata
    chunks: list[ScheduledChunk]  # in flat-batch order (decodes first)
    sample_rows: list[int]  # flat row of each sampled position
    # one per sample row, as the sampler reads it: row j of a verifying chunk samples the token after its
    # first j drafts, so it sees them as output (penalties, min_tokens, a seeded request's draw position)
    sample_chunks: list[ScheduledChunk]
    groups: list[SampleGroup]  # per sampling chunk, its rows
    prompt_logprob_rows: dict[str, list[int]]  # request id → rows whose logits score prompt tokens


class _Rows:
    """Per sequence of the attention metadata: where its rows start, how many, its context after the step,
    and its block table in each KV group."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.lens: list[int] = []
        self.ctx: list[int] = []
        self.tables: list[list[list[int]]] = []

    def add(self, start: int, n: int, ctx: int, blocks: list[list[int]]) -> None:
        self.starts.append(start)
        self.lens.append(n)
        self.ctx.append(ctx)
        self.tables.append(blocks)


def build_inputs(chunks: list[ScheduledChunk], block_size: int, device: torch.device) -> StepInputs:
    ordered = sorted(chunks, key=lambda c: not c.is_decode)  # decodes first, stable
    ids: list[int] = []
    pos: list[int] = []
    seqs = _Rows()
    sample_rows: list[int] = []
    sample_chunks: list[ScheduledChunk] = []
    groups: list[SampleGroup] = []
    plp_rows: dict[str, list[int]] = {}
    for c in ordered:
        row0 = len(ids)
        ids.extend(c.token_ids)
        pos.extend(range(c.start, c.start + c.num_tokens))
        if c.is_decode:
            # Each token a decode row of its own, attending to the context up to itself: a verified draft's
            # logits are then computed as a plain decode of that position computes them, so speculation
            # cannot change which token wins (the decode paths give a row the same result in any batch).
            for j in range(c.num_tokens):
                seqs.add(row0 + j, 1, c.start + j + 1, c.block_ids)
        else:
            seqs.add(row0, c.num_tokens, c.start + c.num_tokens, c.block_ids)
        if c.sample:
            rows = c.num_tokens if c.draft_token_ids else 1
            groups.append(SampleGroup(c, len(sample_rows), rows))
            sample_rows.extend(range(len(ids) - rows, len(ids)))
            sample_chunks.extend(_row_chunks(c, rows))
        if c.sampling.prompt_logprobs is not None:
            last = min(c.start + c.num_tokens, c.num_prompt_tokens - 1)  # row p scores prompt token p + 1
            plp_rows[c.request_id] = list(range(row0, row0 + max(0, last - c.start)))
    num_groups = len(ordered[0].block_ids)
    slots = [
        c.block_ids[g][p // block_size] * block_size + p % block_size
        for g in range(num_groups)
        for c in ordered
        for p in range(c.start, c.start + c.num_tokens)
    ]
    attn = AttentionMetadata(
        slot_mapping=_int64(slots, (num_groups, -1) if num_groups > 1 else (-1,)).to(device),
        query_starts=seqs.starts,
        query_lens=seqs.lens,
        context_lens=seqs.ctx,
        block_tables=_tables(seqs.tables).to(device),
        num_decodes=sum(1 for n in seqs.lens if n == 1),
        block_size=block_size,
    )
    return StepInputs(
        input_ids=torch.tensor(ids, dtype=torch.long, device=device),
        positions=torch.tensor(pos, dtype=torch.long, device=device),
        attn=attn,
        chunks=ordered,
        sample_rows=sample_rows,
        sample_chunks=sample_chunks,
        groups=groups,
        prompt_logprob_rows=plp_rows,
    )


def _row_chunks(c: ScheduledChunk, rows: int) -> list[ScheduledChunk]:
    drafts, out = c.draft_token_ids, c.output_token_ids
    return [c] + [dataclasses.replace(c, output_token_ids=out + drafts[:j]) for j in range(1, rows)]


def _tables(tables: list[list[list[int]]]) -> torch.Tensor:
    """[sequences, widest] block ids, or [groups, sequences, widest] with several KV groups. Padding points
    at the null block, which no sequence writes: a padded read never sees another's K/V."""
    num_groups, width = len(tables[0]), max(len(t[0]) for t in tables)
    flat: list[int] = []
    for g in range(num_groups):
        for t in tables:
            flat += t[g]
            flat += [NULL_BLOCK] * (width - len(t[g]))
    return _int64(flat, (num_groups, len(tables), width) if num_groups > 1 else (len(tables), width))


def _int64(values: list[int], shape: tuple[int, ...]) -> torch.Tensor:
    """An int64 tensor of `values`: through an array, several times faster than `torch.tensor` on a list,
    which counts for the block tables of long sequences (one entry per block, per KV group)."""
    return torch.frombuffer(array("q", values), dtype=torch.long).view(shape)

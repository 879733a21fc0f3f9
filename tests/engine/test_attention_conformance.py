"""Attention-backend conformance: every backend, on every KV dtype, equals dense attention on its cache.

One mixed step holds what a serving step can: decodes of different lengths (their padded block tables
point at the null block), a fresh prompt, a chunk continuing an earlier one, and a prefix hit that shares
another sequence's first blocks. The reference is float64 attention over what the cache stores, read back
with `storage.gather` (for a quantized cache, the dequantized values), so a backend is held to exact
attention over its own cache. Every backend and MLA decode mode named in engine/attention/registry.py
runs all of this; a backend for another device (a CUDA kernel) adds that device to `DEVICES`.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from edgeinfer.engine.attention.backend import get_attention_backend
from edgeinfer.engine.attention.metadata import AttentionMetadata
from edgeinfer.engine.attention.mla import LatentShape, get_latent_attention
from edgeinfer.engine.attention.registry import ATTENTION_BACKENDS, MLA_MODES
from edgeinfer.engine.attention.storage import KVCacheStorage, KVSpec
from edgeinfer.engine.kv_cache import NULL_BLOCK

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
KV_DTYPES = ["auto", "bf16", "int8", "fp8_e4m3", "fp8_e5m2", "int4"]
BS = 4  # block size
HQ, HKV, D = 4, 2, 32  # int4 needs head_dim divisible by its group of 32
MLA = LatentShape(num_heads=4, kv_lora_rank=48, nope_dim=16, rope_dim=16, v_dim=16)


@dataclass
class Seq:
    table: list[int]  # block ids
    cached: int  # tokens already in the cache before the step
    new: int  # tokens this step computes

    @property
    def ctx(self) -> int:
        return self.cached + self.new


def _batch() -> list[Seq]:
    """Decodes first (the metadata's order), then prefill chunks; blocks 1 and 2 serve the prefix hit."""
    return [
        Seq([1, 2, 9, 4], cached=13, new=1),  # decode over four scattered blocks
        Seq([7], cached=2, new=1),  # decode with a one-block table: padded to four with the null block
        Seq([5, 12], cached=0, new=6),  # a fresh prompt
        Seq([3, 11, 6], cached=5, new=4),  # a chunk continuing an earlier one
        Seq([1, 2, 10], cached=8, new=3),  # a prefix hit on the first sequence's two full blocks
    ]


def _slots(seq: Seq, positions: range) -> list[int]:
    return [seq.table[p // BS] * BS + p % BS for p in positions]


def _meta(seqs: list[Seq], device: str) -> AttentionMetadata:
    width = max(len(s.table) for s in seqs)
    tables = torch.full((len(seqs), width), NULL_BLOCK, dtype=torch.long)
    for i, s in enumerate(seqs):
        tables[i, : len(s.table)] = torch.tensor(s.table)
    slots = [x for s in seqs for x in _slots(s, range(s.cached, s.ctx))]
    starts = [sum(s.new for s in seqs[:i]) for i in range(len(seqs))]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, device=device),
        query_starts=starts,
        query_lens=[s.new for s in seqs],
        context_lens=[s.ctx for s in seqs],
        block_tables=tables.to(device),
        num_decodes=sum(s.new == 1 for s in seqs),
        block_size=BS,
    )


def _prior_slots(seqs: list[Seq], device: str) -> torch.Tensor:
    """Slots of the tokens cached before the step; the prefix hit's are its donor's (shared blocks)."""
    slots = {x for s in seqs for x in _slots(s, range(s.cached))}
    return torch.tensor(sorted(slots), device=device)


def _dense(q, k, v, q_pos, scale, window=None, softcap=None) -> torch.Tensor:
    """float64 reference: q [n, Hq, D] at positions q_pos over k/v [S, Hkv, ·] → [n, Hq, Dv]."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(groups, 1), v.double().repeat_interleave(groups, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    k_pos = torch.arange(k.shape[0], device=q.device)
    visible = k_pos <= q_pos[:, None]
    if window is not None:
        visible &= q_pos[:, None] - k_pos < window
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def _storage(spec: KVSpec, kv_dtype: str, device: str) -> KVCacheStorage:
    return KVCacheStorage(spec, 16, BS, torch.float32, torch.device(device), kv_dtype)


def _assert_null_block_untouched(storage: KVCacheStorage) -> None:
    k, v = storage.gather(0, torch.tensor([NULL_BLOCK], device=storage.k[0].data.device))
    assert not k.any() and (v is None or not v.any()), "a backend wrote into the null block"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend_name", list(ATTENTION_BACKENDS))
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize(("window", "softcap"), [(None, None), (5, None), (None, 20.0)])
def test_paged_attention_equals_dense_reference(device, backend_name, kv_dtype, window, softcap) -> None:
    g = torch.Generator().manual_seed(0)
    seqs = _batch()
    storage = _storage(KVSpec(1, HKV, D, HKV, D), kv_dtype, device)
    backend = get_attention_backend(backend_name, storage)
    prior = _prior_slots(seqs, device)
    storage.write(0, prior, *(torch.randn(len(prior), HKV, D, generator=g).to(device) for _ in "kv"))

    meta = _meta(seqs, device)
    t = len(meta.slot_mapping)
    q, k, v = (torch.randn(t, h, D, generator=g).to(device) for h in (HQ, HKV, HKV))
    backend.begin(meta)
    out = backend.attend(0, q, k, v, scale=D**-0.5, window=window, softcap=softcap)

    for i, s in enumerate(seqs):
        kc, vc = storage.gather(0, torch.tensor(s.table, device=device))
        rows = slice(meta.query_starts[i], meta.query_starts[i] + s.new)
        q_pos = torch.arange(s.cached, s.ctx, device=device)
        ref = _dense(q[rows], kc[: s.ctx], vc[: s.ctx], q_pos, D**-0.5, window, softcap)
        torch.testing.assert_close(out[rows].double(), ref, atol=2e-5, rtol=1e-4, msg=f"sequence {i}")
    _assert_null_block_untouched(storage)


def _mla_reference(shape: LatentShape, q_nope, q_pe, latent, kv_b, q_pos, scale) -> torch.Tensor:
    """Per head h: k_h = [W_uk[h] c ; k_pe], v_h = W_uv[h] c over the stored latents, then dense attention."""
    kv = latent[:, : shape.kv_lora_rank].double() @ kv_b.double().T
    kv = kv.view(-1, shape.num_heads, shape.nope_dim + shape.v_dim)
    k_nope, v = kv.split([shape.nope_dim, shape.v_dim], dim=-1)
    k_pe = latent[:, None, shape.kv_lora_rank :].double().expand(-1, shape.num_heads, -1)
    return _dense(torch.cat((q_nope, q_pe), -1), torch.cat((k_nope, k_pe), -1), v, q_pos, scale)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend_name", list(ATTENTION_BACKENDS))
@pytest.mark.parametrize("mode", list(MLA_MODES))
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_latent_attention_equals_dense_reference(device, backend_name, mode, kv_dtype) -> None:
    g = torch.Generator().manual_seed(1)
    seqs = _batch()
    spec = KVSpec(1, 1, MLA.latent_dim, 0, 0)
    storage = _storage(spec, kv_dtype, device)
    backend = get_attention_backend(backend_name, storage)
    prior = _prior_slots(seqs, device)
    storage.write(0, prior, torch.randn(len(prior), 1, MLA.latent_dim, generator=g).to(device), None)

    meta = _meta(seqs, device)
    t = len(meta.slot_mapping)
    q_nope = torch.randn(t, MLA.num_heads, MLA.nope_dim, generator=g).to(device)
    q_pe = torch.randn(t, MLA.num_heads, MLA.rope_dim, generator=g).to(device)
    latent = torch.randn(t, MLA.latent_dim, generator=g).to(device)
    rows = MLA.num_heads * (MLA.nope_dim + MLA.v_dim)
    kv_b = (torch.randn(rows, MLA.kv_lora_rank, generator=g) / 7).to(device)
    scale = (MLA.nope_dim + MLA.rope_dim) ** -0.5
    backend.begin(meta)
    out = get_latent_attention(mode)(backend, 0, MLA, q_nope, q_pe, latent, kv_b, scale)

    for i, s in enumerate(seqs):
        stored = storage.gather(0, torch.tensor(s.table, device=device))[0][: s.ctx, 0]
        rows = slice(meta.query_starts[i], meta.query_starts[i] + s.new)
        q_pos = torch.arange(s.cached, s.ctx, device=device)
        ref = _mla_reference(MLA, q_nope[rows], q_pe[rows], stored, kv_b, q_pos, scale)
        torch.testing.assert_close(out[rows].double(), ref, atol=5e-5, rtol=1e-4, msg=f"sequence {i}")
    _assert_null_block_untouched(storage)


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
@pytest.mark.parametrize("window", [5, 130])
@pytest.mark.parametrize("softcap", [None, 20.0])
def test_windowed_prefill_over_contexts_many_windows_long_equals_dense(kv_dtype, window, softcap) -> None:
    """Prefills far longer than the window and than a tile of query rows: a fresh 300-token prompt and a
    150-token chunk continuing at 200 tokens read only the keys their window reaches, tile by tile."""
    g = torch.Generator().manual_seed(1)
    fresh = Seq(list(range(1, 76)), cached=0, new=300)
    chunk = Seq(list(range(76, 164)), cached=200, new=150)
    seqs = [fresh, chunk]
    storage = KVCacheStorage(KVSpec(1, HKV, D, HKV, D), 170, BS, torch.float32, torch.device("cpu"), kv_dtype)
    backend = get_attention_backend("torch", storage)
    prior = torch.tensor(_slots(chunk, range(chunk.cached)))
    storage.write(0, prior, *(torch.randn(len(prior), HKV, D, generator=g) for _ in "kv"))
    meta = _meta(seqs, "cpu")
    t = len(meta.slot_mapping)
    q, k, v = (torch.randn(t, h, D, generator=g) for h in (HQ, HKV, HKV))
    backend.begin(meta)
    out = backend.attend(0, q, k, v, scale=D**-0.5, window=window, softcap=softcap)
    for i, s in enumerate(seqs):
        kc, vc = storage.gather(0, torch.tensor(s.table))
        rows = slice(meta.query_starts[i], meta.query_starts[i] + s.new)
        ref = _dense(
            q[rows], kc[: s.ctx], vc[: s.ctx], torch.arange(s.cached, s.ctx), D**-0.5, window, softcap
        )
        torch.testing.assert_close(out[rows].double(), ref, atol=2e-5, rtol=1e-4, msg=f"sequence {i}")

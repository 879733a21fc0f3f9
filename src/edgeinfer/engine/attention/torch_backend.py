"""Paged attention with torch SDPA: works on CPU and CUDA, no custom kernels.

Decodes (one query token per sequence) are attended in one padded batch; prefill chunks one sequence
at a time, directly on the new K/V when the chunk is the whole context (no cache gather). A prefill of a
sliding-window layer reads only the keys its window reaches (the cache from the block holding the
chunk's first reachable key) and attends in tiles of query rows, each over its own rows and the window
before them, so such a layer costs the window per token however long the context is.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from edgeinfer.engine.attention.backend import AttentionBackend
from edgeinfer.engine.attention.metadata import AttentionMetadata
from edgeinfer.engine.kernels import ops

# A windowed layer's prefill attends in tiles of max(window, MIN_TILE) query rows: a tile reads its rows'
# keys and the window before them, so larger tiles read less per row, smaller ones compute less of what
# the band mask then throws away.
MIN_TILE = 128


def _mask(
    q_pos: torch.Tensor, ctx_len: torch.Tensor, length: int, window: int | None, first_key: int = 0
) -> torch.Tensor:
    """Bool mask [..., q, length] over keys at positions first_key .. first_key + length - 1: key j
    visible to query at q_pos iff j <= q_pos, j < ctx_len and (with a window) q_pos - j < window."""
    k_pos = torch.arange(first_key, first_key + length, device=q_pos.device)
    visible = (k_pos <= q_pos.unsqueeze(-1)) & (k_pos < ctx_len.unsqueeze(-1).unsqueeze(-1))
    if window is not None:
        visible &= q_pos.unsqueeze(-1) - k_pos < window
    return visible


def _sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    """q [B, Hq, L, D], k/v [B, Hkv, S, D] → [B, Hq, L, Dv]."""
    if softcap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
        )
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    scores = torch.tanh(scores / softcap) * softcap
    if mask is None:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(scores.softmax(-1).to(v.dtype), v)


def _attend_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    """q [n, Hq, D] over k/v [S, Hkv, D] (token-major, as the cache and the projections lay them out)."""
    out = _sdpa(
        q.transpose(0, 1).unsqueeze(0),
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        mask,
        scale,
        softcap,
    )
    return out.squeeze(0).transpose(0, 1)


def _grouped_decode(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float, softcap: float | None
) -> torch.Tensor:
    """One query token per sequence: q [B, Hq, D], k/v [B, S, Hkv, D], additive bias [B, 1, 1, S].

    Plain batched matmuls with the query heads of each KV head grouped together (no K/V repeat). On CPU
    this is much faster than SDPA's flash kernel, which is built for long query blocks, not q_len = 1.
    """
    b, hq, d = q.shape
    hkv = k.shape[2]
    qg = q.view(b, hkv, hq // hkv, d)
    if b == 1:
        # K @ q^T: K as [B, Hkv, S, D] keeps the gathered cache's unit inner stride, so a compiled
        # one-sequence graph need not copy K^T out for every layer, and an eager sequence is faster too;
        # with several sequences this form is slower, hence only here
        scores = torch.matmul(k.transpose(1, 2), qg.transpose(-1, -2)).transpose(-1, -2)
    else:
        scores = torch.matmul(qg, k.permute(0, 2, 3, 1))
    scores = scores.float() * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    probs = (scores + bias).softmax(-1).to(v.dtype)
    return torch.matmul(probs, v.transpose(1, 2)).view(b, hq, v.shape[-1])


class TorchPagedBackend(AttentionBackend):
    """With `decode_ops`, over a bf16 cache or an int8 / float8 one (`storage.kernel_readable`), a
    one-sequence decode step takes one call of our `paged_decode_one` (write, then attend over the blocks
    where they lie) per layer, and the decodes of a batched step one call of `paged_decode` (attend over
    each sequence's blocks, no gather, a quantized cache's codes read as they are stored)."""

    def attend(self, layer, q, k, v, scale, window=None, softcap=None):
        meta = self.meta
        assert meta is not None, "begin() must be called before attend()"
        group = self.storage.group_of(layer)
        if self._takes_decode_op(layer, meta, q, softcap):
            return self._decode_one(layer, group, q, k, v, meta, scale, window)
        self.storage.write(layer, meta.group_slots(group), k, v)
        out = torch.empty(q.shape[0], q.shape[1], v.shape[-1], dtype=q.dtype, device=q.device)
        nd = meta.num_decodes
        if nd:
            out[:nd] = self._decode(layer, q[:nd], meta, scale, window, softcap)
        for i in range(nd, meta.num_seqs):
            s, n = meta.query_starts[i], meta.query_lens[i]
            out[s : s + n] = self._prefill(
                layer, group, i, q[s : s + n], k[s : s + n], v[s : s + n], meta, scale, window, softcap
            )
        return out

    def _takes_decode_op(
        self, layer: int, meta: AttentionMetadata, q: torch.Tensor, softcap: float | None
    ) -> bool:
        return meta.num_decodes == meta.num_seqs == 1 and self._takes_batch_op(layer, q, softcap)

    def _takes_batch_op(self, layer: int, q: torch.Tensor, softcap: float | None) -> bool:
        """Whether our decode attention ops take this layer: on, a cache they read, no softcap."""
        return (
            self.decode_ops
            and softcap is None
            and q.dtype == torch.bfloat16
            and self.storage.kernel_readable
            and self.storage.v[layer] is not None
            and not torch.compiler.is_compiling()
        )

    def _decode_one(self, layer, group, q, k, v, meta: AttentionMetadata, scale, window) -> torch.Tensor:
        key = ("slot", group)
        if key not in meta.cache:  # one read of the step's slot, not one per layer
            meta.cache[key] = int(meta.group_slots(group)[0])
        k_pool, v_pool, k_scales, v_scales = self.storage.kernel_pools(layer)
        ctx = meta.context_lens[0]
        slot, table = meta.cache[key], meta.group_tables(group)[0]
        return ops.paged_decode_one(
            q, k, v, k_pool, v_pool, slot, table, ctx, scale, window or 0, k_scales, v_scales
        )

    def _decode(self, layer, q, meta: AttentionMetadata, scale, window, softcap) -> torch.Tensor:
        nd, group = meta.num_decodes, self.storage.group_of(layer)
        if self._takes_batch_op(layer, q, softcap):
            if "decode_ctx" not in meta.cache:
                meta.cache["decode_ctx"] = meta.decode_context_lens(q.device)
            k_pool, v_pool, k_scales, v_scales = self.storage.kernel_pools(layer)
            tables, ctx = meta.group_tables(group)[:nd], meta.cache["decode_ctx"]
            return ops.paged_decode(q, k_pool, v_pool, tables, ctx, scale, window or 0, k_scales, v_scales)
        key = ("decode", window, group)
        if key not in meta.cache:
            ctx = meta.decode_context_lens(q.device)
            n_blocks = -(-max(meta.context_lens[:nd]) // meta.block_size)
            mask = _mask((ctx - 1).view(nd, 1), ctx, n_blocks * meta.block_size, window)
            bias = torch.zeros(mask.shape, device=q.device).masked_fill_(~mask, float("-inf"))
            meta.cache[key] = (meta.group_tables(group)[:nd, :n_blocks], bias.unsqueeze(1))
        blocks, bias = meta.cache[key]
        kc, vc = self.storage.gather(layer, blocks)
        return _grouped_decode(q, kc, vc, bias, scale, softcap)

    def _prefill(
        self, layer, group, i, q, k, v, meta: AttentionMetadata, scale, window, softcap
    ) -> torch.Tensor:
        n, ctx = meta.query_lens[i], meta.context_lens[i]
        windowed = window is not None and window < ctx
        # the first key any query of the chunk sees, rounded down to its block where it is read from cache
        first = max(0, ctx - n - window + 1) if windowed else 0
        # With a quantized cache, attend to what was stored even for a fresh prompt, so that a prefix-cache
        # hit (which can only read stored values) computes exactly what the miss did.
        if ctx != n or not self.storage.lossless:
            first -= first % meta.block_size
            blocks = meta.group_tables(group)[i, first // meta.block_size : -(-ctx // meta.block_size)]
            k, v = self.storage.gather(layer, blocks)
            k, v = k[: ctx - first], v[: ctx - first]
        else:
            k, v = k[first:], v[first:]
        if windowed:
            return self._windowed(
                q, k, v, ctx - n, first, window, scale, softcap, meta.cache, ("tile", i, window)
            )
        mask = None
        if ctx != n:
            key = ("prefill", i)
            if key not in meta.cache:
                q_pos = torch.arange(ctx - n, ctx, device=q.device)
                meta.cache[key] = _mask(q_pos, torch.tensor(ctx, device=q.device), ctx, None)
            mask = meta.cache[key]
        return _attend_rows(q, k, v, mask, scale, softcap)

    def _windowed(self, q, k, v, q_start, k_start, window, scale, softcap, cache, key) -> torch.Tensor:
        """Queries at positions q_start.. over keys at k_start.., each seeing the `window` keys up to itself,
        a tile of rows at a time (module docstring)."""
        n = q.shape[0]
        tile = max(window, MIN_TILE)
        out = torch.empty(n, q.shape[1], v.shape[-1], dtype=q.dtype, device=q.device)
        for a in range(0, n, tile):
            b = min(n, a + tile)
            lo, hi = max(k_start, q_start + a - window + 1), q_start + b
            if (key, a) not in cache:
                q_pos = torch.arange(q_start + a, q_start + b, device=q.device)
                cache[(key, a)] = _mask(q_pos, torch.tensor(hi, device=q.device), hi - lo, window, lo)
            rows = slice(lo - k_start, hi - k_start)
            out[a:b] = _attend_rows(q[a:b], k[rows], v[rows], cache[(key, a)], scale, softcap)
        return out

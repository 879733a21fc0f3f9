"""Paged multi-head latent attention (MLA, DeepSeek-V2/V3, Kimi K2) over a cache of compressed latents.

The cache holds, per token and layer, one latent `[c ; k_pe]`: the normalised KV compression `c`
(`kv_lora_rank` values) and the rotated shared rope key `k_pe` (`rope_dim` values). Per head h, with
`kv_b_proj` split into `W_uk[h]` [nope, rank] and `W_uv[h]` [v, rank]:

    k_h = [W_uk[h] c ; k_pe]      v_h = W_uv[h] c

Two ways to attend over it, both exact:

- **expand**: materialise k_h, v_h for every context token, then ordinary attention.
  Cost per query ~ S · H · rank · (nope + v) for the up-projection of S context tokens.
- **absorb**: fold `W_uk` into the query (`q_lat = W_uk[h]^T q_nope`) and `W_uv` into the output, so
  all heads attend one shared latent key/value (multi-query attention with head dim rank + rope_dim).
  Cost per query ~ H · (S · (rank + rope) + rank · (nope + v)): the context is never up-projected.

Prefill chunks always expand (their queries share the up-projection, and rank > nope); decodes use the
mode the model was built with (`EngineConfig.mla_mode`, `--mla-mode`; the names and the default are in
registry.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from edgeinfer.engine.attention.backend import AttentionBackend
from edgeinfer.engine.attention.metadata import AttentionMetadata
from edgeinfer.engine.attention.registry import MLA_MODES, load_class
from edgeinfer.engine.kernels import ops


@dataclass(frozen=True)
class LatentShape:
    num_heads: int
    kv_lora_rank: int
    nope_dim: int
    rope_dim: int
    v_dim: int

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.rope_dim


class LatentAttention(ABC):
    """Writes the step's latents into the backend's storage and attends every query to its context.

    `q_nope` [T, H, nope] and `q_pe` [T, H, rope] (rotated); `latent` [T, rank + rope] (new tokens);
    `kv_b` [H·(nope + v), rank] is the layer's `kv_b_proj` weight. Returns [T, H, v].
    """

    name: str

    def __call__(
        self,
        backend: AttentionBackend,
        layer: int,
        shape: LatentShape,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        latent: torch.Tensor,
        kv_b: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        meta = backend.meta
        assert meta is not None, "begin() must be called before attention"
        backend.storage.write(layer, meta.slot_mapping, latent.unsqueeze(1), None)
        out = q_nope.new_empty(q_nope.shape[0], shape.num_heads, shape.v_dim)
        nd = meta.num_decodes
        if nd and self.takes_kernel(backend, q_nope, kv_b):
            out[:nd] = _kernel_decode(backend, layer, q_nope[:nd], q_pe[:nd], kv_b, scale)
        elif nd:
            cache, mask = _decode_context(backend, layer, meta)
            out[:nd] = self.decode(shape, q_nope[:nd], q_pe[:nd], cache, mask, kv_b, scale)
        for i in range(nd, meta.num_seqs):
            s, n = meta.query_starts[i], meta.query_lens[i]
            rows = slice(s, s + n)
            out[rows] = _prefill(
                backend, layer, i, shape, q_nope[rows], q_pe[rows], latent[rows], kv_b, scale
            )
        return out

    def takes_kernel(self, backend: AttentionBackend, q: torch.Tensor, kv_b: torch.Tensor) -> bool:
        """Whether the decodes run through our `mla_decode` (absorb mode, with the backend's decode ops on
        and a plain bf16 cache); the fused decode step (model/fused_decode.py) calls it too."""
        return False

    @abstractmethod
    def decode(
        self,
        shape: LatentShape,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        cache: torch.Tensor,
        mask: torch.Tensor,
        kv_b: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """One query per sequence: q [B, H, ·], cache [B, S, rank + rope], mask [B, S] → [B, H, v]."""


class AbsorbLatentAttention(LatentAttention):
    name = "absorb"

    def takes_kernel(self, backend: AttentionBackend, q: torch.Tensor, kv_b: torch.Tensor) -> bool:
        return (
            backend.decode_ops
            and q.dtype == kv_b.dtype == torch.bfloat16
            and backend.storage.lossless
            and kv_b.is_contiguous()
            and not torch.compiler.is_compiling()
        )

    def decode(self, shape, q_nope, q_pe, cache, mask, kv_b, scale):
        w = kv_b.view(shape.num_heads, shape.nope_dim + shape.v_dim, shape.kv_lora_rank)
        w_uk, w_uv = w[:, : shape.nope_dim], w[:, shape.nope_dim :]
        q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [B, H, rank]
        q = torch.cat((q_lat, q_pe), dim=-1).unsqueeze(1)  # [B, 1, H, ·]: one shared K/V, heads as rows
        k = cache.unsqueeze(1)
        v = cache[..., : shape.kv_lora_rank].unsqueeze(1)
        o_lat = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :], scale=scale)
        return torch.bmm(o_lat.squeeze(1).transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)


class ExpandLatentAttention(LatentAttention):
    name = "expand"

    def decode(self, shape, q_nope, q_pe, cache, mask, kv_b, scale):
        k, v = _expand(shape, cache, kv_b)  # [B, S, H, ·]
        q = torch.cat((q_nope, q_pe), dim=-1).unsqueeze(2)  # [B, H, 1, qk]
        out = F.scaled_dot_product_attention(
            q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask[:, None, None, :], scale=scale
        )
        return out.squeeze(2)


def get_latent_attention(mode: str) -> LatentAttention:
    """The decode mode named `mode` (absorb or expand)."""
    return load_class(MLA_MODES, mode, "MLA mode")()


def _expand(
    shape: LatentShape, latent: torch.Tensor, kv_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """latent [..., S, rank + rope] → K [..., S, H, nope + rope], V [..., S, H, v]."""
    kv = F.linear(latent[..., : shape.kv_lora_rank], kv_b)
    kv = kv.view(*latent.shape[:-1], shape.num_heads, shape.nope_dim + shape.v_dim)
    k_nope, v = kv.split([shape.nope_dim, shape.v_dim], dim=-1)
    k_pe = latent[..., shape.kv_lora_rank :].unsqueeze(-2).expand(*k_nope.shape[:-1], shape.rope_dim)
    return torch.cat((k_nope, k_pe), dim=-1), v


def _kernel_decode(
    backend: AttentionBackend,
    layer: int,
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_b: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The absorbed decode through our kernel, over the latents where they lie in their blocks."""
    meta = backend.meta
    assert meta is not None
    if "decode_ctx" not in meta.cache:
        meta.cache["decode_ctx"] = meta.decode_context_lens(q_nope.device)
    tables, ctx = meta.block_tables[: meta.num_decodes], meta.cache["decode_ctx"]
    pool = backend.storage.k[layer].data
    return ops.mla_decode(q_nope, q_pe, pool, kv_b, tables, ctx, scale)


def _decode_context(
    backend: AttentionBackend, layer: int, meta: AttentionMetadata
) -> tuple[torch.Tensor, torch.Tensor]:
    """The decodes' cached latents [B, S, rank + rope] (S padded to whole blocks) and the valid-key mask."""
    key = "mla-decode"
    if key not in meta.cache:
        nd = meta.num_decodes
        n_blocks = -(-max(meta.context_lens[:nd]) // meta.block_size)
        blocks = meta.block_tables[:nd, :n_blocks]
        ctx = meta.decode_context_lens(blocks.device)
        mask = torch.arange(n_blocks * meta.block_size, device=blocks.device) < ctx.unsqueeze(1)
        meta.cache[key] = (blocks, mask)
    blocks, mask = meta.cache[key]
    return backend.storage.gather(layer, blocks)[0].squeeze(-2), mask


def _prefill(
    backend: AttentionBackend,
    layer: int,
    i: int,
    shape: LatentShape,
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    latent: torch.Tensor,
    kv_b: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Sequence i's chunk of n queries over its ctx keys: the chunk's own latents when it is the whole
    context, else the cached ones (prefix hit or an earlier chunk)."""
    meta = backend.meta
    n, ctx = meta.query_lens[i], meta.context_lens[i]
    mask = None
    # With a quantized cache, attend to what was stored even for a fresh prompt (as the GQA backend does),
    # so that a prefix-cache hit, which can only read stored latents, computes exactly what the miss did.
    if ctx != n or not backend.storage.lossless:
        n_blocks = -(-ctx // meta.block_size)
        latent = backend.storage.gather(layer, meta.block_tables[i, :n_blocks])[0][:ctx, 0]
        q_pos = torch.arange(ctx - n, ctx, device=latent.device)
        mask = torch.arange(ctx, device=latent.device) <= q_pos.unsqueeze(1)
    k, v = _expand(shape, latent, kv_b)
    q = torch.cat((q_nope, q_pe), dim=-1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.transpose(0, 1),
        v.transpose(0, 1),
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
    )
    return out.transpose(0, 1)

"""Typed calls of our CPU kernels' ops (`torch.ops.edgeinfer_cpu`) and classes, for every room that uses them.

Each call loads the extension first where nothing in the process has (`load()`, which raises
KernelBuildError where it cannot be built); once it has, a call adds a flag check to the op, and
`torch.compile` traces through it to the op itself (the matmuls have fakes).
"""

from __future__ import annotations

import torch

from edgeinfer.engine import kernels


def _ensure_loaded() -> None:
    """`kernels.load()` unless it has run: its flag costs what its cache would, and compiles away."""
    if not kernels.loaded:
        kernels.load()


def isa() -> str:
    """The instruction-set level the kernels run at here (`kernels.ISA_LEVELS`)."""
    _ensure_loaded()
    return torch.ops.edgeinfer_cpu.isa()


def int8_gemv(
    xq: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor
) -> torch.Tensor:
    """int8 codes `[M, K]` x row-major int8 weight `[N, K]`, scaled per token and per row -> fp32 `[M, N]`."""
    _ensure_loaded()
    return torch.ops.edgeinfer_cpu.int8_gemv(xq, x_scale, w, w_scale)


def int8_gemv_out(
    xq: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, out: torch.Tensor
) -> None:
    """`int8_gemv` written into a contiguous fp32 `out` `[M, N]`."""
    _ensure_loaded()
    torch.ops.edgeinfer_cpu.int8_gemv_out(xq, x_scale, w, w_scale, out)


def int8_gemv_kn(
    xq: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor
) -> torch.Tensor:
    """`int8_gemv` with the weight stored `[K, N]` -> fp32 `[M, N]`."""
    _ensure_loaded()
    return torch.ops.edgeinfer_cpu.int8_gemv_kn(xq, x_scale, w, w_scale)


def int4_gemv(
    x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, zero_terms: torch.Tensor, group: int
) -> torch.Tensor:
    """bf16 / fp32 `x` `[M, K]` x an int4 weight in `int4_pack`'s layout (W4A8) -> fp32 `[M, N]`."""
    _ensure_loaded()
    return torch.ops.edgeinfer_cpu.int4_gemv(x, codes, scales, zero_terms, group)


def bf16_gemv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """bf16 `x` `[M, K]` x bf16 weight `[N, K]` (as stored), fp32 sums -> bf16 `[M, N]`."""
    _ensure_loaded()
    return torch.ops.edgeinfer_cpu.bf16_gemv(x, w)


def bf16_gemv_out(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
    """`bf16_gemv` written into `out` `[M, N]` (fp32: the sums unrounded, or bf16)."""
    _ensure_loaded()
    torch.ops.edgeinfer_cpu.bf16_gemv_out(x, w, out)


def lossless_gemv(
    x: torch.Tensor,
    low_bytes: torch.Tensor,
    planes: torch.Tensor,
    escapes: torch.Tensor,
    offsets: torch.Tensor,
    table: torch.Tensor,
) -> torch.Tensor:
    """`bf16_gemv` on a weight in the lossless form (kernels/lossless.py): the same sums -> bf16 `[M, N]`."""
    _ensure_loaded()
    return torch.ops.edgeinfer_cpu.lossless_gemv(x, low_bytes, planes, escapes, offsets, table)


def lossless_gemv_out(
    x: torch.Tensor,
    low_bytes: torch.Tensor,
    planes: torch.Tensor,
    escapes: torch.Tensor,
    offsets: torch.Tensor,
    table: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """`lossless_gemv` written into `out` `[M, N]` (fp32: the sums unrounded, or bf16)."""
    _ensure_loaded()
    torch.ops.edgeinfer_cpu.lossless_gemv_out(x, low_bytes, planes, escapes, offsets, table, out)


def lossless_decode(
    k: int,
    low_bytes: torch.Tensor,
    planes: torch.Tensor,
    escapes: torch.Tensor,
    offsets: torch.Tensor,
    table: torch.Tensor,
) -> torch.Tensor:
    """The bf16 matrix `[N, k]` of a lossless form, decoded whole."""
    _ensure_loaded()
    return torch.ops.edgeinfer_cpu.lossless_decode(k, low_bytes, planes, escapes, offsets, table)


def lossless_rows(
    ids: torch.Tensor,
    k: int,
    low_bytes: torch.Tensor,
    planes: torch.Tensor,
    escapes: torch.Tensor,
    offsets: torch.Tensor,
    table: torch.Tensor,
) -> torch.Tensor:
    """Rows `ids` of a lossless form's bf16 matrix -> `[*ids.shape, k]` (an embedding lookup)."""
    _ensure_loaded()
    return torch.ops.edgeinfer_cpu.lossless_rows(ids, k, low_bytes, planes, escapes, offsets, table)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, round_first: bool) -> torch.Tensor:
    """RMSNorm of contiguous bf16 rows; `round_first`: Llama's rounding, else Gemma's fp32 `1 + w` scale."""
    _ensure_loaded()
    return torch.ops.edgeinfer_cpu.rms_norm(x, weight, eps, round_first)


def rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int, interleaved: bool
) -> torch.Tensor:
    """Rotary embedding of the first `rotary_dim` values of each head of bf16 `x` `[T, H, D]`."""
    _ensure_loaded()
    return torch.ops.edgeinfer_cpu.rope(x, cos, sin, rotary_dim, interleaved)


def gated_act(gate_up: torch.Tensor, act: int) -> torch.Tensor:
    """`act(gate) * up` of bf16 `[T, 2I]` rows holding `[gate; up]` -> `[T, I]`; `act` a `gated_act` code."""
    _ensure_loaded()
    return torch.ops.edgeinfer_cpu.gated_act(gate_up, act)


def paged_decode_one(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slot: int,
    blocks: torch.Tensor,
    ctx: int,
    scale: float,
    window: int,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """One sequence's decode attention: its K/V written into `slot` (quantized where the pools hold int8 /
    float8 codes with their `k_scales` / `v_scales`), its query over its blocks in place."""
    _ensure_loaded()
    return torch.ops.edgeinfer_cpu.paged_decode_one(
        q, k, v, k_pool, v_pool, slot, blocks, ctx, scale, window, k_scales, v_scales
    )


def paged_decode(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    ctx_lens: torch.Tensor,
    scale: float,
    window: int,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention of a batch of sequences over their blocks in place (their K/V already written);
    pools of int8 / float8 codes come with their scales."""
    _ensure_loaded()
    return torch.ops.edgeinfer_cpu.paged_decode(
        q, k_pool, v_pool, block_tables, ctx_lens, scale, window, k_scales, v_scales
    )


def kv_write(pool: torch.Tensor, scales: torch.Tensor | None, slots: torch.Tensor, x: torch.Tensor) -> None:
    """bf16 `x` `[T, heads, dim]` into a paged pool at flat `slots`: as it is, or quantized into an int8 /
    float8 pool and its `scales` as quant/kv.py quantizes it."""
    _ensure_loaded()
    torch.ops.edgeinfer_cpu.kv_write(pool, scales, slots, x)


def mla_decode(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    latent_pool: torch.Tensor,
    kv_b: torch.Tensor,
    block_tables: torch.Tensor,
    ctx_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Latent attention's absorbed decode over the latents in their blocks, `kv_b` read where it lies."""
    _ensure_loaded()
    return torch.ops.edgeinfer_cpu.mla_decode(q_nope, q_pe, latent_pool, kv_b, block_tables, ctx_lens, scale)


def packed_attention(qkv: torch.Tensor, cu_seqlens: torch.Tensor, scale: float) -> torch.Tensor:
    """Bidirectional attention of a packed encoder batch `[T, 3, H, D]`, each sequence over its own tokens."""
    _ensure_loaded()
    return torch.ops.edgeinfer_cpu.packed_attention(qkv, cu_seqlens, scale)


def lora_add(
    out: torch.Tensor,
    x: torch.Tensor,
    rows: torch.Tensor,
    a: list[torch.Tensor],
    b: list[torch.Tensor],
    plan: torch.Tensor,
) -> None:
    """Each adapter group's LoRA delta added to `out` `[T, N]` in place, from `x` `[T, in]` at its `rows`
    (bf16 or fp32; the layout of `a`, `b` and `plan`: lora.cpp, engine/lora/weights.py)."""
    _ensure_loaded()
    torch.ops.edgeinfer_cpu.lora_add(out, x, rows, a, b, plan)


def dense_decode_step(gemv_rows: int, max_elements: int) -> torch.ScriptObject:
    """An empty `DenseDecodeStep` (dense_step.cpp), its layers added one `add_layer` at a time."""
    _ensure_loaded()
    return torch.classes.edgeinfer_cpu.DenseDecodeStep(gemv_rows, max_elements)


def moe_block(tensors: dict[str, torch.Tensor], numbers: dict[str, float]) -> torch.ScriptObject:
    """A `MoeBlock` (moe_block.cpp) over a sparse MoE block's weights and settings, by name."""
    _ensure_loaded()
    return torch.classes.edgeinfer_cpu.MoeBlock(tensors, numbers)

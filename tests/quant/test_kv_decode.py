"""Quantized KV caches in our decode attention (kernels/decode_ops.cpp, kv_codes.h, kv_write.cpp): int8 and
float8 codes read where they lie, against attention over the dequantized cache; the step's new K/V stored
as the storage's quantizers store them; and models with such a cache decoding through the fused step."""

from __future__ import annotations

import pytest
import torch
from helpers.fused_step import assert_fused_step_decodes_as_eager, bf16_engine, greedy_answers
from helpers.kernels import capped_isa

from edgeinfer.engine import kernels
from edgeinfer.engine.attention.metadata import AttentionMetadata
from edgeinfer.engine.attention.storage import KVCacheStorage, KVSpec
from edgeinfer.engine.attention.torch_backend import TorchPagedBackend

QUANTIZED = ["int8", "fp8_e4m3", "fp8_e5m2"]
BS = 16  # block size


@pytest.fixture(params=["scalar", "avx2", "avx512", "avx512_bf16"])
def any_level(request, ops):
    """Each variant of the attention in turn, AVX512-BF16's too (each only where the CPU has it)."""
    yield from capped_isa(ops, request.param)


def _rows(n: int, heads: int, dim: int, seed: int, decades: float = 1) -> torch.Tensor:
    """bf16 K or V rows whose tokens' magnitudes span 10^-decades .. 10^decades, some of them all zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, heads, dim, generator=g) * torch.logspace(-decades, decades, n).view(n, 1, 1)
    x[:: max(1, n // 5)] = 0
    return x[torch.randperm(n, generator=g)].bfloat16()


@pytest.mark.parametrize("kv_dtype", QUANTIZED)
def test_kv_write_stores_what_the_storage_writes(ops, kv_dtype):
    """The fused step's write (C++) and the eager path's (quant/kv.py) leave the same bytes and scales."""
    spec = KVSpec(1, 3, 64, 3, 64)
    stores = [KVCacheStorage(spec, 40, BS, torch.bfloat16, torch.device("cpu"), kv_dtype) for _ in range(2)]
    x = _rows(300, 3, 64, seed=1, decades=3)
    x[3, 1, :4] = 1e-30  # scales near fp32's smallest normal
    slots = torch.randperm(41 * BS, generator=torch.Generator().manual_seed(2))[:300]
    stores[0].write(0, slots, x, x)
    pool = stores[1].k[0]
    ops.kv_write(pool.data, pool.scales, slots, x)
    a, b = stores[0].k[0], pool
    assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8))
    assert torch.equal(a.scales, b.scales)


def _filled(kv_dtype: str, batch: int, width: int, hkv: int, d: int) -> tuple[KVCacheStorage, torch.Tensor]:
    """A one-layer cache of `batch` sequences' `width` blocks each, every slot written; their block tables."""
    storage = KVCacheStorage(
        KVSpec(1, hkv, d, hkv, d), batch * width, BS, torch.bfloat16, torch.device("cpu"), kv_dtype
    )
    slots = torch.arange(BS, (1 + batch * width) * BS)
    storage.write(0, slots, _rows(len(slots), hkv, d, seed=3), _rows(len(slots), hkv, d, seed=4, decades=3))
    return storage, torch.arange(1, 1 + batch * width).reshape(batch, width)


def _exact(
    storage: KVCacheStorage, q: torch.Tensor, tables: torch.Tensor, ctxs: list[int], window: int
) -> torch.Tensor:
    """float64 attention over each sequence's stored values (codes times their fp32 scales, unrounded)."""
    q8 = storage.quantizer
    outs = []
    for b, ctx in enumerate(ctxs):
        first = max(0, ctx - window) if window else 0
        k, v = (
            q8.gather_blocks(p.data, p.scales, tables[b], torch.float64)[first:ctx]
            for p in (storage.k[0], storage.v[0])
        )
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = torch.einsum("hd,khd->hk", q[b].double(), k) * q.shape[-1] ** -0.5
        outs.append(torch.einsum("hk,khd->hd", scores.softmax(-1), v))
    return torch.stack(outs)


def _eager(
    storage: KVCacheStorage, q: torch.Tensor, tables: torch.Tensor, ctxs: list[int], window: int
) -> torch.Tensor:
    """The eager path without our attention: the blocks gathered and dequantized to bf16, grouped matmuls."""
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(len(ctxs), dtype=torch.long),
        query_starts=list(range(len(ctxs))),
        query_lens=[1] * len(ctxs),
        context_lens=ctxs,
        block_tables=tables,
        num_decodes=len(ctxs),
        block_size=BS,
    )
    backend = TorchPagedBackend(storage)
    backend.begin(meta)
    return backend._decode(0, q, meta, q.shape[-1] ** -0.5, window or None, None)


GEMMA = (4, 1, 256)  # (query heads, KV heads, head dim): Gemma 3's grouping
SHORT = [
    ([1, 15, 16, 17, 200], 0),  # around the 16-key tiles
    ([37, 9, 48], 20),  # a sliding window
]
LONG = [
    ([1, 2049, 5000], 0),  # past 2,048 keys: a chunk of keys at a time on AVX512-BF16
    ([2049, 5000], 3000),
]
# a wider GQA, and a head dim the AVX512-BF16 variant does not take (the fp32 loops run at every level)
CASES = [(GEMMA, *c) for c in SHORT + LONG] + [
    (layout, *c) for layout in ((8, 2, 64), (4, 2, 16)) for c in SHORT
]


@pytest.mark.parametrize(("layout", "ctxs", "window"), CASES, ids=lambda x: str(x).replace(" ", ""))
@pytest.mark.parametrize("kv_dtype", QUANTIZED)
def test_quantized_decode_attention_is_as_exact_as_the_eager_path(any_level, kv_dtype, layout, ctxs, window):
    """Against float64 attention over the stored values: the kernel rounds scores and probabilities to bf16
    as the eager path does, and leaves the dequantized values unrounded where the eager path rounds each
    to bf16, so it is within the eager path's error, and within a bf16 step or two of it."""
    hq, hkv, d = layout
    storage, tables = _filled(kv_dtype, len(ctxs), -(-max(ctxs) // BS), hkv, d)
    q = _rows(len(ctxs), hq, d, seed=5)
    k_pool, v_pool, k_scales, v_scales = storage.kernel_pools(0)
    lens = torch.tensor(ctxs)
    fast = torch.ops.edgeinfer_cpu.paged_decode(
        q, k_pool, v_pool, tables, lens, d**-0.5, window, k_scales, v_scales
    )
    exact, eager = _exact(storage, q, tables, ctxs, window), _eager(storage, q, tables, ctxs, window)
    scale = exact.abs().amax(-1, keepdim=True)  # errors relative to each head's largest output
    fast_err, eager_err = ((x.double() - exact).abs() / scale for x in (fast, eager))
    assert fast_err.mean() <= eager_err.mean() and fast_err.max() <= 1.5 * eager_err.max()
    assert ((fast.double() - eager.double()).abs() <= 2.0**-6 * scale).all()


@pytest.mark.parametrize("kv_dtype", QUANTIZED)
def test_levels_read_quantized_codes_alike(ops, kv_dtype):
    """Every variant turns the codes into the same values: their outputs differ only by the order of fp32
    sums (a bf16 step now and then)."""
    storage, tables = _filled(kv_dtype, 3, 19, 1, 256)
    k_pool, v_pool, k_scales, v_scales = storage.kernel_pools(0)
    q, lens = _rows(3, 4, 256, seed=6), torch.tensor([1, 17, 300])
    outs = {}
    try:
        for level in kernels.ISA_LEVELS:
            ops.set_isa_cap(level)
            if ops.isa() == level:
                outs[level] = ops.paged_decode(q, k_pool, v_pool, tables, lens, 1 / 16, 0, k_scales, v_scales)
    finally:
        ops.set_isa_cap(kernels.ISA_LEVELS[-1])
    top = outs.pop(ops.isa())
    for level, out in outs.items():
        steps = (out.view(torch.int16).int() - top.view(torch.int16).int()).abs()
        assert steps.max() <= 2 and (steps > 0).float().mean() < 0.05, level


def test_paged_decode_refuses_codes_without_their_scales(ops):
    storage, tables = _filled("int8", 1, 2, 1, 32)
    k_pool, v_pool, k_scales, v_scales = storage.kernel_pools(0)
    q, lens = _rows(1, 2, 32, seed=11), torch.tensor([20])
    with pytest.raises(RuntimeError, match="needs its contiguous fp32 scales"):
        ops.paged_decode(q, k_pool, v_pool, tables, lens, 1.0, 0)
    with pytest.raises(RuntimeError, match="a bf16 pool has no scales"):
        bf16 = torch.zeros(k_pool.shape, dtype=torch.bfloat16)
        ops.paged_decode(q, bf16, bf16, tables, lens, 1.0, 0, k_scales, v_scales)
    with pytest.raises(RuntimeError, match="different dtypes"):
        fp8 = torch.zeros(k_pool.shape, dtype=torch.float8_e4m3fn)
        ops.paged_decode(q, k_pool, fp8, tables, lens, 1.0, 0, k_scales, v_scales)


def test_a_long_quantized_sequence_decodes_alike_alone_in_a_batch_and_on_any_thread_count(ops):
    ctxs = [5000, 17, 300]
    storage, tables = _filled("int8", 3, 313, 1, 256)
    q = _rows(3, 4, 256, seed=7)
    k_pool, v_pool, k_scales, v_scales = storage.kernel_pools(0)

    def decode(rows: slice) -> torch.Tensor:
        lens = torch.tensor(ctxs[rows])
        return ops.paged_decode(q[rows], k_pool, v_pool, tables[rows], lens, 1 / 16, 0, k_scales, v_scales)

    together = decode(slice(0, 3))
    assert torch.equal(together, torch.cat([decode(slice(i, i + 1)) for i in range(3)]))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(decode(slice(0, 3)), together)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3"])
def test_the_backend_attends_a_quantized_cache_through_the_ops(ops, kv_dtype):
    """One-sequence and batched decode steps through the backend with the ops on: the same bytes written as
    without them (paged_decode_one quantizes in C++), the outputs as the eager path's up to its rounding."""
    hq, hkv, d = 4, 2, 64
    tables, ctxs = [[5, 2, 7], [3], [1, 6, 4]], [37, 9, 48]
    slots = [t[(c - 1) // BS] * BS + (c - 1) % BS for t, c in zip(tables, ctxs, strict=True)]
    q, k, v = _rows(3, hq, d, seed=8), _rows(3, hkv, d, seed=9), _rows(3, hkv, d, seed=10)
    for rows in (slice(0, 1), slice(0, 3)):
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots[rows]),
            query_starts=list(range(rows.stop)),
            query_lens=[1] * rows.stop,
            context_lens=ctxs[rows],
            block_tables=torch.tensor([t + [0] * (3 - len(t)) for t in tables[rows]]),
            num_decodes=rows.stop,
            block_size=BS,
        )
        results, pools = [], []
        for decode_ops in (False, True):
            storage, _ = _filled(kv_dtype, 4, 2, hkv, d)
            backend = TorchPagedBackend(storage)
            backend.decode_ops = decode_ops
            backend.begin(meta)
            results.append(backend.attend(0, q[rows], k[rows], v[rows], d**-0.5))
            pools.append([t.view(torch.uint8) for t in storage.kernel_pools(0)])
        assert all(torch.equal(a, b) for a, b in zip(*pools, strict=True))
        eager, fast = results
        scale = eager.float().abs().amax(-1, keepdim=True)
        assert ((fast.float() - eager.float()).abs() <= 2.0**-6 * scale).all()


PROMPTS = [[3, 14, 15, 92, 65], list(range(4, 26)), [7] * 9, list(range(100, 140))]
MAX_TOKENS = 12


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("family", ["gemma3", "qwen3", "llama"])
def test_the_fused_step_takes_a_quantized_cache(ops, tiny_models, family, kv_dtype):
    """With an int8 / float8 cache the fused step takes every decode step and decodes as the eager path with
    the same cache does, bit for bit; the eager path without our attention (dequantize, then grouped
    matmuls) chooses the same tokens but at a near-tie."""
    if not kernels.cpu_has_avx2():
        pytest.skip("bf16 models keep torch's kernels without AVX2")
    engine = bf16_engine(tiny_models[family], kv_cache_dtype=kv_dtype)
    fused = engine.runner.fused
    assert_fused_step_decodes_as_eager(engine, PROMPTS, MAX_TOKENS)  # asserts it took every decode step
    engine.runner.fused = fused
    ours = greedy_answers(engine, PROMPTS, MAX_TOKENS, together=True)
    engine.runner.fused, engine.runner.backend.decode_ops = None, False
    torch_attention = greedy_answers(engine, PROMPTS, MAX_TOKENS, together=True)
    for (a, lps_a), (b, lps_b) in zip(ours, torch_attention, strict=True):
        same = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), MAX_TOKENS)
        assert lps_a[:same] == pytest.approx(lps_b[:same], abs=0.05)
        if same < MAX_TOKENS:  # only where its two best tokens were all but tied
            top = lps_a[MAX_TOKENS + 3 * same :]
            assert top[0] - top[1] < 0.05, (family, same)

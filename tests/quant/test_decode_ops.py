"""Our one-call decode ops (kernels/decode_ops.cpp) against the torch ops they replace, at every
instruction-set level this CPU runs, and switched on for models that run on our kernels."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from edgeinfer.engine import kernels
from edgeinfer.engine.attention.metadata import AttentionMetadata
from edgeinfer.engine.attention.storage import KVCacheStorage, KVSpec
from edgeinfer.engine.attention.torch_backend import TorchPagedBackend
from edgeinfer.engine.config import EngineConfig
from edgeinfer.engine.engine import LLMEngine
from edgeinfer.engine.kernels.limits import EVERY_INPUT, KernelLimits
from edgeinfer.engine.model.layers.kernel_ops import takes_kernel
from edgeinfer.engine.model.layers.norm import RMSNorm
from edgeinfer.engine.model.layers.rotary import RotaryEmbedding
from edgeinfer.types import SamplingParams


def _bf16(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


def _ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many bf16 steps apart each pair is (same-sign values: their bit patterns' distance)."""
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


@pytest.mark.parametrize("unit_offset", [True, False], ids=["gemma", "llama"])
@pytest.mark.parametrize("shape", [(1, 640), (3, 4, 256), (70, 100), (300, 640)])  # decode, prefill
def test_rms_norm_rounds_as_the_torch_norm(level, unit_offset, shape):
    norm = RMSNorm(shape[-1], 1e-6, unit_offset).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(_bf16(shape[-1], seed=1) * 0.3)
    x = _bf16(*shape, seed=2) * 4
    eager = norm(x)
    norm.kernel_elements = EVERY_INPUT
    fast = norm(x)
    assert fast.shape == eager.shape and fast.dtype == torch.bfloat16
    # the fp32 sum of squares in another order moves a result by at most one bf16 step, and rarely
    apart = _ulps_apart(fast, eager)
    assert apart.max() <= 1 and apart.float().mean() < 0.02, (apart.max(), apart.float().mean())


def _storage(heads: int, dim: int, blocks: int, v_dim: int | None = None) -> KVCacheStorage:
    spec = KVSpec(1, heads, dim, heads, v_dim or dim)
    storage = KVCacheStorage(spec, blocks, 16, torch.bfloat16, torch.device("cpu"))
    for pool in (storage.k[0], storage.v[0]):
        pool.data[1:] = _bf16(*pool.data[1:].shape, seed=pool.data.numel() % 97)  # block 0 stays zero
    return storage


def _meta(ctx: int, table: list[int]) -> AttentionMetadata:
    slot = table[(ctx - 1) // 16] * 16 + (ctx - 1) % 16
    return AttentionMetadata(
        slot_mapping=torch.tensor([slot]),
        query_starts=[0],
        query_lens=[1],
        context_lens=[ctx],
        block_tables=torch.tensor([table + [0]]),  # padded with the null block, as the runner pads
        num_decodes=1,
        block_size=16,
    )


@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("ctx", [1, 37, 48])
@pytest.mark.parametrize("dv", [64, 96], ids=["v=k", "v-wider"])
def test_paged_decode_one_matches_the_gather_path(level, window, ctx, dv):
    hq, hkv, d, table = 4, 2, 64, [5, 2, 7]  # grouped query heads, blocks out of order
    q, k, v = _bf16(1, hq, d, seed=3), _bf16(1, hkv, d, seed=4), _bf16(1, hkv, dv, seed=5)
    results, pools = [], []
    for decode_ops in (False, True):
        storage = _storage(hkv, d, 8, dv)
        backend = TorchPagedBackend(storage)
        backend.decode_ops = decode_ops
        backend.begin(_meta(ctx, table))
        results.append(backend.attend(0, q, k, v, d**-0.5, window))
        pools.append((storage.k[0].data, storage.v[0].data))
    eager, fast = results
    assert fast.shape == eager.shape == (1, hq, dv)
    # both write the new token's K/V to the same slot and nothing else
    assert torch.equal(pools[0][0], pools[1][0]) and torch.equal(pools[0][1], pools[1][1])
    # the same roundings (bf16 scores, bf16 probabilities); fp32 sums in another order
    assert torch.allclose(fast.float(), eager.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("window", [None, 20])
def test_paged_decode_of_a_batch_matches_the_gather_path(level, window):
    hq, hkv, d, dv = 4, 2, 64, 96
    tables = [[5, 2, 7], [3], [1, 6, 4]]  # out of order, of different lengths (padded with the null block)
    ctxs = [37, 9, 48]
    slots = [t[(c - 1) // 16] * 16 + (c - 1) % 16 for t, c in zip(tables, ctxs, strict=True)]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        query_starts=[0, 1, 2],
        query_lens=[1, 1, 1],
        context_lens=ctxs,
        block_tables=torch.tensor([t + [0] * (4 - len(t)) for t in tables]),
        num_decodes=3,
        block_size=16,
    )
    q, k, v = _bf16(3, hq, d, seed=3), _bf16(3, hkv, d, seed=4), _bf16(3, hkv, dv, seed=5)
    results = []
    for decode_ops in (False, True):
        backend = TorchPagedBackend(_storage(hkv, d, 8, dv))
        backend.decode_ops = decode_ops
        backend.begin(meta)
        results.append(backend.attend(0, q, k, v, d**-0.5, window))
    eager, fast = results
    assert fast.shape == eager.shape == (3, hq, dv)
    assert torch.allclose(fast.float(), eager.float(), atol=2e-2, rtol=2e-2)


def test_paged_decode_refuses_a_block_table_too_short(ops):
    storage = _storage(1, 32, 4)
    q = _bf16(2, 2, 32, seed=0)
    with pytest.raises(RuntimeError, match="cannot hold"):
        ops.paged_decode(
            q, storage.k[0].data, storage.v[0].data, torch.tensor([[1], [2]]), torch.tensor([5, 20]), 1.0, 0
        )


def test_paged_decode_one_refuses_a_block_table_too_short(ops):
    storage = _storage(1, 32, 4)
    q, kv = _bf16(1, 2, 32, seed=0), _bf16(1, 1, 32, seed=1)
    with pytest.raises(RuntimeError, match="cannot hold"):
        ops.paged_decode_one(
            q, kv, kv, storage.k[0].data, storage.v[0].data, 17, torch.tensor([1]), 20, 1.0, 0
        )


def test_models_on_our_kernels_decode_through_the_ops_alike(ops, tiny_models):
    if not kernels.cpu_has_avx2():
        pytest.skip("bf16 models keep torch's kernels without AVX2")
    sp = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=2)
    prompt = [[3, 14, 15, 92, 65]]
    for family in ("gemma3", "qwen3", "llama"):
        plain = LLMEngine(EngineConfig(model=tiny_models[family], cpu_gemv=False, num_kv_blocks=64))
        fast = LLMEngine(EngineConfig(model=tiny_models[family], num_kv_blocks=64))
        assert fast.runner.backend.decode_ops and not plain.runner.backend.decode_ops
        assert all(m.kernel_elements for m in fast.model.modules() if isinstance(m, RMSNorm))
        (a,), (b,) = plain.generate(prompt, sp), fast.generate(prompt, sp)
        for ta, tb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert tb.logprob == pytest.approx(ta.logprob, abs=0.05), family
            if ta.token_id != tb.token_id:  # only at a near-tie
                assert ta.top[0][1] - ta.top[1][1] < 0.05, family
                break


@pytest.mark.parametrize("interleaved", [False, True], ids=["halves", "pairs"])
@pytest.mark.parametrize("rotary_dim", [64, 32], ids=["full", "partial"])
def test_rope_rounds_as_the_torch_rotation(level, interleaved, rotary_dim):
    rope = RotaryEmbedding(rotary_dim, {"rope_theta": 10000.0}, 128, interleaved)
    positions = torch.tensor([0, 5, 77])
    q, k = _bf16(3, 4, 64, seed=6), _bf16(3, 2, 64, seed=7)
    eager = rope(positions, q, k)
    rope.kernel_elements, rope._step_cache = EVERY_INPUT, None
    fast = rope(positions, q, k)
    for a, b in zip(eager, fast, strict=True):
        assert torch.equal(a, b)  # elementwise: the same roundings in the same order


@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("rows", [3, 300])
def test_gated_act_rounds_as_the_torch_ops(ops, level, act, rows):
    gate_up = _bf16(rows, 192, seed=8) * 3
    gate, up = gate_up[:, :96], gate_up[:, 96:]
    eager = (F.silu(gate) if act == "silu" else F.gelu(gate, approximate="tanh")) * up
    fast = ops.gated_act(gate_up, 0 if act == "silu" else 1)
    if act == "silu" or level in ("scalar", "avx2"):
        assert torch.equal(fast, eager)  # e^-|g| within an ulp of Sleef's exp: the same bf16 results here
        return
    # gelu's tanh is ours with AVX-512: for y << 0, 1 + tanh(y) cancels, so its rounding and Sleef's move
    # the activation by up to ~2^-24 x |gate| (many bf16 steps only where the result is near 0)
    bound = (2.0**-8 * torch.maximum(fast.float().abs(), eager.float().abs())).clamp_min(
        2.0**-21 * (gate.float() * up.float()).abs()
    )
    assert ((fast.float() - eager.float()).abs() <= bound).all()
    assert (fast != eager).float().mean() < 0.05


def test_inputs_past_the_size_limit_keep_the_torch_ops(ops):
    norm = RMSNorm(640, 1e-6, True).to(torch.bfloat16)
    x = _bf16(16_384 // 640 + 1, 640, seed=9)  # a prefill chunk: torch's parallel kernels win there
    eager = norm(x)
    norm.kernel_elements = 16_384  # the limit without AVX-512
    assert not takes_kernel(norm, x) and takes_kernel(norm, x[:1])
    assert torch.equal(norm(x), eager)


def test_every_input_takes_the_kernels_where_they_have_avx512():
    avx512 = KernelLimits.for_flags(frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512vl"}))
    assert avx512.decode_op_elements == EVERY_INPUT
    assert KernelLimits.for_flags(frozenset({"avx2", "fma"})).decode_op_elements == 16_384


def _gemma_shaped(ctxs: list[int], width: int) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """Block tables, K/V pools and queries of Gemma 3's shape (4 query heads of 256 per KV head)."""
    tables = torch.arange(1, 1 + len(ctxs) * width).reshape(len(ctxs), width)
    pools = [_bf16(1 + len(ctxs) * width, 16, 1, 256, seed=s) for s in (1, 2)]
    return tables, pools, _bf16(len(ctxs), 4, 256, seed=3)


@pytest.mark.parametrize(
    ("ctxs", "window", "ulps"),
    [
        # around the 16-key tiles
        ([1, 15, 16, 17, 200], 0, 2),
        ([1, 15, 16, 17, 200], 20, 2),
        # past 2,048 keys, a chunk of keys at a time (decode_ops.cpp, attend_chunked): thousands of fp32
        # terms summed in another order, a few ulps on outputs that nearly cancel
        ([1, 2049, 5000], 0, 4),
        ([1, 2049, 5000], 3000, 4),
    ],
)
def test_bf16_decode_attention_matches_the_fp32_loops(ops, ctxs, window, ulps):
    """The `vdpbf16ps` scores and vector softmax against the fp32 loops of the AVX-512 level: the same
    roundings (bf16 scores and probabilities); fp32 sums and e^x in another order."""
    if "avx512_bf16" not in kernels.cpu_flags():
        pytest.skip("no AVX512-BF16 here")
    tables, pools, q = _gemma_shaped(ctxs, -(-max(ctxs) // 16))
    lens = torch.tensor(ctxs)
    try:
        fast = ops.paged_decode(q, *pools, tables, lens, 256**-0.5, window)
        ops.set_isa_cap("avx512")
        loops = ops.paged_decode(q, *pools, tables, lens, 256**-0.5, window)
    finally:
        ops.set_isa_cap(kernels.ISA_LEVELS[-1])
    assert _ulps_apart(fast, loops).max() <= ulps and (fast != loops).float().mean() < 0.02


def test_a_long_sequence_decodes_alike_alone_in_a_batch_and_on_any_thread_count(ops):
    """Its chunks follow from its length alone: the same bits alone, beside short sequences (which then go
    through the chunked path too), and on one thread or two."""
    ctxs = [5000, 17, 300]
    tables, pools, q = _gemma_shaped(ctxs, 313)
    together = ops.paged_decode(q, *pools, tables, torch.tensor(ctxs), 256**-0.5, 0)
    alone = [
        ops.paged_decode(q[i : i + 1], *pools, tables[i : i + 1], torch.tensor([c]), 256**-0.5, 0)
        for i, c in enumerate(ctxs)
    ]
    assert torch.equal(together, torch.cat(alone))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ops.paged_decode(q, *pools, tables, torch.tensor(ctxs), 256**-0.5, 0)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, together)

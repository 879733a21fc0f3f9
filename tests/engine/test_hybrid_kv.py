"""The hybrid KV cache end to end: a tiny Gemma 3 whose sliding layers (window 16, in two groups of two)
and global layers (one group) keep separate block tables in one pool, at contexts many windows long —
against transformers, chunked, as prefix hits and after preemption, with windowed blocks given back as the
sequence grows, and through the fused decode step over bf16, int8 and float8 caches."""

from __future__ import annotations

import pytest
import torch
from helpers.fused_step import assert_fused_step_decodes_as_eager, bf16_engine, greedy_answers
from helpers.tiny_models import make_tiny
from transformers import AutoModelForCausalLM

from edgeinfer.engine import kernels
from edgeinfer.engine.engine import LLMEngine
from edgeinfer.types import EngineRequest, SamplingParams

WINDOW, BS = 16, 4
LAYERS = ["sliding_attention", "sliding_attention", "full_attention"] * 2
PROMPT = torch.randint(3, 380, (300,), generator=torch.Generator().manual_seed(5)).tolist()


@pytest.fixture(scope="module")
def windowed(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("hybrid") / "gemma3"
    return str(
        make_tiny(
            "gemma3",
            path,
            num_hidden_layers=6,
            layer_types=LAYERS,
            sliding_window=WINDOW,
            max_position_embeddings=1024,
        )
    )


@pytest.fixture(scope="module")
def reference(windowed):
    """transformers' greedy continuation of PROMPT and its log-softmax at every position."""
    hf = AutoModelForCausalLM.from_pretrained(windowed, dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf.generate(torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False, pad_token_id=0)
        expected = out[0, len(PROMPT) :].tolist()
        logprobs = torch.log_softmax(hf(torch.tensor([PROMPT + expected])).logits[0].float(), -1)
    return expected, logprobs


def _groups(engine: LLMEngine) -> tuple[int | None, ...]:
    return engine.layout.kv_groups.windows


def test_the_layout_splits_windowed_and_global_layers(windowed, engine_factory):
    eng = engine_factory(windowed, block_size=BS)
    assert _groups(eng) == (WINDOW, WINDOW, None) and eng.layout.kv_groups.slots == 2
    assert _groups(engine_factory(windowed, hybrid_kv_cache=False)) == (None,)


def test_tokens_and_logprobs_match_transformers(windowed, reference, engine_factory):
    """Whole, in 48-token chunks, as a prefix hit that ends inside a window, and without the hybrid cache:
    greedy tokens equal HF's and every chosen token's logprob is HF's."""
    expected, ref = reference
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=1)
    engines = {
        "whole": engine_factory(windowed, num_kv_blocks=512),
        "chunked": engine_factory(windowed, num_kv_blocks=512, max_num_batched_tokens=48, max_step_ms=None),
        "cached": engine_factory(windowed, num_kv_blocks=512),
        "one group": engine_factory(windowed, num_kv_blocks=512, hybrid_kv_cache=False),
    }
    engines["cached"].generate([PROMPT[:203]], SamplingParams(max_tokens=1, temperature=0.0))
    for name, engine in engines.items():
        (res,) = engine.generate([PROMPT], sp)
        assert res.token_ids == expected, name
        ours = [lp for o in res.outputs for lp in o.logprobs]
        for i, lp in enumerate(ours):
            assert abs(lp.logprob - ref[len(PROMPT) - 1 + i, lp.token_id].item()) < 1e-4, name
    assert engines["cached"].stats().prefix_cache_hits == 200  # the first 203 tokens' 50 whole blocks


def test_windowed_groups_give_blocks_back_while_the_global_group_grows(windowed, engine_factory):
    """Every step of a long generation: each windowed group holds at most its window's blocks and the
    block the next token goes to, the books balance; the output is the one-group cache's."""
    eng = engine_factory(windowed, num_kv_blocks=512)
    sp = SamplingParams(max_tokens=150, temperature=0.0, ignore_eos=True)
    eng.add_request(EngineRequest("long", PROMPT[:60], sp))
    kv, held = eng.scheduler.kv, []
    while eng.has_unfinished_requests():
        eng.step()
        eng.check_integrity()
        held.append([kv.in_use(g) for g in range(kv.num_groups)])
    assert max(h[g] for h in held for g in (0, 1)) <= WINDOW // BS + 2
    assert max(h[2] for h in held) >= (60 + 140) // BS  # the global group: every token's block
    plain = engine_factory(windowed, num_kv_blocks=512, hybrid_kv_cache=False)
    ours = eng.generate([PROMPT[:60]], sp)[0].token_ids
    assert ours == plain.generate([PROMPT[:60]], sp)[0].token_ids


def test_preempted_requests_resume_across_the_window_edge(windowed, engine_factory):
    """A pool that holds one long request's blocks but not two: the later one is preempted, recomputed
    from what the prefix cache kept (its windowed groups only the window before the hit), and both answers
    are those of a pool that never preempts."""
    prompts = [PROMPT[:150], PROMPT[100:250]]
    sp = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    small = engine_factory(windowed, num_kv_blocks=90, max_num_batched_tokens=32, max_step_ms=None)
    roomy = engine_factory(windowed, num_kv_blocks=512)
    assert [c.token_ids for c in small.generate(prompts, sp)] == [
        c.token_ids for c in roomy.generate(prompts, sp)
    ]
    assert small.scheduler.num_preemptions > 0
    assert small.stats().prefix_cache_hits > 0


@pytest.mark.parametrize("kv_dtype", ["auto", "int8", "fp8_e4m3"])
def test_the_fused_step_reads_each_layers_group(windowed, kv_dtype):
    """bf16 with our kernels: the fused step takes every decode step of prompts several windows long and
    decodes as the eager path does, bit for bit, and as the one-group cache does."""
    if not kernels.cpu_has_avx2():
        pytest.skip("bf16 models keep torch's kernels without AVX2")
    prompts = [PROMPT[:100], PROMPT[50:110], PROMPT[:7]]
    hybrid = bf16_engine(windowed, kv_cache_dtype=kv_dtype, num_kv_blocks=256)
    assert len(_groups(hybrid)) == 3
    assert_fused_step_decodes_as_eager(hybrid, prompts, 20)
    plain = bf16_engine(windowed, kv_cache_dtype=kv_dtype, num_kv_blocks=256, hybrid_kv_cache=False)
    assert greedy_answers(hybrid, prompts, 20, True) == greedy_answers(plain, prompts, 20, True)

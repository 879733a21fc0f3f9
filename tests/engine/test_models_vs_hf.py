"""Every dense family against HF transformers on tiny random checkpoints, in fp32."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from edgeinfer.engine.attention.backend import get_attention_backend
from edgeinfer.engine.attention.metadata import AttentionMetadata
from edgeinfer.engine.attention.storage import KVCacheStorage
from edgeinfer.types import SamplingParams

FAMILIES = ["llama", "qwen3", "gemma3", "llama_bias"]
PROMPTS = [[5, 17, 42, 99, 3, 250, 7, 8, 9, 10, 11], [300, 301, 5, 6]]


@pytest.fixture(scope="module")
def hf_models(tiny_models):
    return {
        f: AutoModelForCausalLM.from_pretrained(tiny_models[f], dtype=torch.float32).eval() for f in FAMILIES
    }


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, do_sample=False, min_new_tokens=n, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_and_logprobs_match_transformers(family, tiny_models, hf_models, engine_factory):
    eng = engine_factory(tiny_models[family])
    sp = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=5)
    results = eng.generate(PROMPTS, sp)
    for prompt, res in zip(PROMPTS, results, strict=True):
        expected = hf_greedy(hf_models[family], prompt, 40)
        assert res.token_ids == expected
        # Our reported logprob of each chosen token equals HF's log-softmax at that step.
        full = torch.tensor([prompt + res.token_ids])
        with torch.no_grad():
            ref = torch.log_softmax(hf_models[family](full).logits[0].float(), -1)
        ours = [lp for o in res.outputs for lp in o.logprobs]
        for i, lp in enumerate(ours):
            assert abs(lp.logprob - ref[len(prompt) - 1 + i, lp.token_id].item()) < 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_paged_logits_match_transformers_within_1e3(family, tiny_models, hf_models, engine_factory):
    """Prefill a chunk, then decode token by token through scattered cache blocks: every step's logits
    equal HF's full-sequence logits within 1e-3 (the sliding window of Gemma 3 is crossed)."""
    eng = engine_factory(tiny_models[family])
    model = eng.model
    ids = torch.randint(3, 380, (24,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf_models[family](ids[None]).logits[0]
    storage = KVCacheStorage(model.kv_spec, 16, 4, torch.float32, torch.device("cpu"))
    backend = get_attention_backend("torch", storage)
    blocks = [9, 2, 14, 16, 5, 11]

    def meta(start: int, n: int) -> AttentionMetadata:
        slots = [blocks[p // 4] * 4 + p % 4 for p in range(start, start + n)]
        return AttentionMetadata(
            torch.tensor(slots), [0], [n], [start + n], torch.tensor([blocks]), int(n == 1), 4
        )

    outs = []
    with torch.no_grad():
        backend.begin(meta(0, 10))
        outs.append(model.compute_logits(model(ids[:10], torch.arange(10), backend)))
        for p in range(10, 24):
            backend.begin(meta(p, 1))
            outs.append(model.compute_logits(model(ids[p : p + 1], torch.tensor([p]), backend)))
    assert (torch.cat(outs) - ref).abs().max().item() < 1e-3


def test_gemma3_at_contexts_many_windows_long_matches_transformers(tiny_models, hf_models, engine_factory):
    """Gemma 3's sliding layers (window 8) over a 300-token prompt, far past the window and past a tile of
    query rows: prefilled whole, in 48-token chunks, and as a prefix hit whose cached part ends inside a
    window; greedy tokens equal HF's and every chosen token's logprob is HF's."""
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, 380, (300,), generator=g).tolist()
    expected = hf_greedy(hf_models["gemma3"], prompt, 12)
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=1)
    with torch.no_grad():
        ref = torch.log_softmax(hf_models["gemma3"](torch.tensor([prompt + expected])).logits[0].float(), -1)
    whole = engine_factory(tiny_models["gemma3"], num_kv_blocks=512)
    chunked = engine_factory(
        tiny_models["gemma3"], num_kv_blocks=512, max_num_batched_tokens=48, max_step_ms=None
    )
    cached = engine_factory(tiny_models["gemma3"], num_kv_blocks=512)
    cached.generate([prompt[:203]], SamplingParams(max_tokens=1, temperature=0.0))  # 50 blocks of 4 cached
    for engine in (whole, chunked, cached):
        (res,) = engine.generate([prompt], sp)
        assert res.token_ids == expected
        ours = [lp for o in res.outputs for lp in o.logprobs]
        for i, lp in enumerate(ours):
            assert abs(lp.logprob - ref[len(prompt) - 1 + i, lp.token_id].item()) < 1e-4

"""Sampling controls, stops and logprobs through the real engine on a tiny model."""

from __future__ import annotations

import math

import pytest
import torch

from edgeinfer.engine.runner.sampler import Sampler, greedy_argmax, inverse_cdf
from edgeinfer.engine.scheduler import ScheduledChunk
from edgeinfer.types import FinishReason, SamplingParams

PROMPT = [10, 20, 30, 40, 50, 60]


def test_seed_makes_sampling_reproducible_and_varied(tiny_llama, engine_factory):
    eng = engine_factory(tiny_llama)
    sp = lambda seed: SamplingParams(max_tokens=20, temperature=1.0, seed=seed, ignore_eos=True)  # noqa: E731
    a, b, c = eng.generate([PROMPT, PROMPT, PROMPT], [sp(1), sp(1), sp(2)])
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_top_k_one_is_greedy(tiny_llama, engine_factory):
    eng = engine_factory(tiny_llama)
    greedy, topk = eng.generate(
        [PROMPT, PROMPT],
        [
            SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
            SamplingParams(max_tokens=16, temperature=1.5, top_k=1, seed=3, ignore_eos=True),
        ],
    )
    assert greedy.token_ids == topk.token_ids


def test_max_tokens_and_length_reason(tiny_llama, engine_factory):
    eng = engine_factory(tiny_llama)
    (res,) = eng.generate([PROMPT], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    assert len(res.token_ids) == 5 and res.finish_reason == FinishReason.LENGTH


def test_stop_token_ids_end_generation(tiny_llama, engine_factory):
    eng = engine_factory(tiny_llama)
    (free,) = eng.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    stop_at = free.token_ids[4]
    (res,) = eng.generate(
        [PROMPT], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_at])
    )
    first = free.token_ids.index(stop_at)
    assert res.token_ids == free.token_ids[: first + 1] and res.finish_reason == FinishReason.STOP


def test_stop_string_cuts_text_and_is_never_streamed(tiny_llama, engine_factory):
    eng = engine_factory(tiny_llama)
    (free,) = eng.generate([PROMPT], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    text = free.text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), "the tiny model's output is too short to pick a stop string"
    (res,) = eng.generate(
        [PROMPT], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop])
    )
    assert res.finish_reason == FinishReason.STOP
    assert res.text == text[: text.index(stop)]
    streamed = ""
    for out in res.outputs:
        streamed += out.text_delta
        assert stop not in streamed


def test_min_tokens_suppresses_eos(tiny_llama, engine_factory):
    eng = engine_factory(tiny_llama)
    (free,) = eng.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    eos_like = free.token_ids[0]
    (res,) = eng.generate(
        [PROMPT], SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=[eos_like], min_tokens=3)
    )
    assert len(res.token_ids) >= 3 and eos_like not in res.token_ids[:3]


def test_logprobs_are_normalised_and_top_sorted(tiny_llama, engine_factory):
    eng = engine_factory(tiny_llama)
    (res,) = eng.generate(
        [PROMPT], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3)
    )
    lps = [lp for o in res.outputs for lp in o.logprobs]
    assert len(lps) == 6
    for lp, tok in zip(lps, res.token_ids, strict=True):
        assert lp.token_id == tok and lp.logprob <= 0
        assert len(lp.top) == 3 and lp.top[0][0] == tok  # greedy picks the top token
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)


def test_prompt_logprobs_cover_every_prompt_token(tiny_llama, engine_factory):
    eng = engine_factory(tiny_llama, max_num_batched_tokens=4)  # chunked prefill too
    (res,) = eng.generate([PROMPT], SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=2))
    plp = res.outputs[0].prompt_logprobs
    assert plp is not None and len(plp) == len(PROMPT) and plp[0] is None
    assert [p.token_id for p in plp[1:]] == PROMPT[1:]
    assert all(p.logprob <= 0 and len(p.top) == 2 for p in plp[1:])


def _chunk(rid: str, **kw) -> ScheduledChunk:
    return ScheduledChunk(rid, [1], 0, [0], True, SamplingParams(**kw), [1, 2, 2], [2, 2, 3], 3)


def test_penalties_shift_logits_as_specified():
    logits = torch.zeros(1, 6)
    logits[0, 2], logits[0, 3] = 2.0, -2.0
    out = Sampler._apply_penalties(logits.clone(), [_chunk("a", repetition_penalty=2.0)])
    assert out[0, 2].item() == 1.0 and out[0, 3].item() == -4.0 and out[0, 1].item() == 0.0
    out = Sampler._apply_penalties(
        logits.clone(), [_chunk("b", presence_penalty=0.5, frequency_penalty=0.25)]
    )
    assert math.isclose(out[0, 2].item(), 2.0 - 0.5 - 2 * 0.25)  # token 2 generated twice
    assert math.isclose(out[0, 3].item(), -2.0 - 0.5 - 0.25)
    assert out[0, 1].item() == 0.0  # prompt-only tokens are not penalised by presence/frequency


def test_top_p_and_min_p_only_sample_allowed_tokens():
    sampler = Sampler()
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    for seed in range(30):
        tok = sampler.sample(logits, [_chunk(f"p{seed}", temperature=1.0, top_p=0.7, seed=seed)]).tokens
        assert tok[f"p{seed}"] in (0, 1)
        tok = sampler.sample(logits, [_chunk(f"m{seed}", temperature=1.0, min_p=0.5, seed=seed)]).tokens
        assert tok[f"m{seed}"] in (0, 1)


def test_nan_logits_fail_only_that_request():
    sampler = Sampler()
    logits = torch.tensor([[0.0, 1.0, 2.0], [float("nan"), 0.0, 1.0]])
    res = sampler.sample(logits, [_chunk("ok", temperature=0.0), _chunk("bad", temperature=0.0)])
    assert res.tokens == {"ok": 2} and "bad" in res.errors


def test_nan_row_sampled_at_temperature_with_logprobs_fails_alone():
    """The inverse CDF of a NaN row must still give an index that logprob gathering accepts."""
    logits = torch.tensor([[0.0, 1.0, 2.0], [float("nan"), 0.0, 1.0]])
    chunks = [_chunk("ok", temperature=1.0, seed=1, logprobs=1), _chunk("bad", temperature=1.0, logprobs=1)]
    res = Sampler().sample(logits, chunks)
    assert set(res.tokens) == {"ok"} and 0 <= res.tokens["ok"] < 3 and "bad" in res.errors


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", -1.0),
        ("top_p", 0.0),
        ("max_tokens", 0),
        ("top_k", -5),
        ("logprobs", 99),
        ("min_p", 2.0),
    ],
)
def test_bad_sampling_values_are_refused(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_padded_vocabulary_rows_are_never_sampled(tiny_llama, tmp_path):
    """A checkpoint whose embedding has more rows than the tokenizer has tokens: even when the padding
    rows have the highest logits, sampling stays inside the tokenizer's vocabulary."""
    import json
    import shutil

    from engine.conftest import make_engine
    from safetensors.torch import load_file, save_file

    padded = tmp_path / "padded"
    shutil.copytree(tiny_llama, padded)
    cfg = json.loads((padded / "config.json").read_text())
    extra = 8
    cfg["vocab_size"] += extra
    (padded / "config.json").write_text(json.dumps(cfg))
    weights = next(padded.glob("*.safetensors"))
    t = load_file(weights)
    t["model.embed_tokens.weight"] = torch.cat([t["model.embed_tokens.weight"], torch.zeros(extra, 64)])
    t["lm_head.weight"] = torch.cat([t["lm_head.weight"], torch.full((extra, 64), 5.0)])  # padding wins
    save_file(t, weights, metadata={"format": "pt"})
    eng = make_engine(str(padded))
    limit = eng.tokenizer.vocab_size
    for sp in (SamplingParams(max_tokens=8, temperature=0.0), SamplingParams(max_tokens=8, seed=1)):
        (res,) = eng.generate([PROMPT], sp)
        assert res.token_ids and max(res.token_ids) < limit


def test_inverse_cdf_matches_the_distribution_and_skips_zero_mass():
    g = torch.Generator().manual_seed(0)
    vocab = 3000  # not a multiple of the block width: the padded tail must never be picked
    probs = torch.zeros(2, vocab)
    probs[0, [5, 1500, 2999]] = torch.tensor([0.2, 0.3, 0.5])
    probs[1] = torch.rand(vocab, generator=g) ** 8
    probs[1, ::2] = 0.0  # every even id impossible
    probs[1] /= probs[1].sum()
    n = 20000
    u = torch.rand(n, generator=g)
    picks0 = inverse_cdf(probs[0].expand(n, vocab), u)
    freq = torch.bincount(picks0, minlength=vocab).float() / n
    assert set(picks0.unique().tolist()) == {5, 1500, 2999}
    assert torch.allclose(freq[[5, 1500, 2999]], torch.tensor([0.2, 0.3, 0.5]), atol=0.015)
    picks1 = inverse_cdf(probs[1].expand(n, vocab), u)
    assert bool((picks1 % 2 == 1).all())
    # edges: u = 0 gives the first possible id, u just below 1 the last
    edge = inverse_cdf(probs[:1].expand(2, vocab), torch.tensor([0.0, 1 - 1e-9]))
    assert edge.tolist() == [5, 2999]


@pytest.mark.parametrize("vocab", [1, 1000, 1024, 5000, 262144])
def test_greedy_argmax_matches_torch_argmax(vocab):
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, vocab, generator=gen)
    # ties across and inside blocks: argmax takes the first; so must the two-level pass
    logits[1] = 0.0
    logits[2, [vocab // 3, vocab - 1]] = 50.0
    logits[3, -1] = 40.0
    logits[4] = float("-inf")
    logits[5, vocab // 2] = float("nan")
    assert torch.equal(greedy_argmax(logits), logits.argmax(-1))

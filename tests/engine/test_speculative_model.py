"""Drafts by a model (runner/draft.py): self-speculation (the served model's own int4 form drafts) and a
separate draft model of the same vocabulary. Verification decides every token, so greedy and seeded
outputs equal those without speculation for every dense family, alone and batched, through chunked prefill,
preemption and prefix-cache hits; unseeded sampling keeps its distribution; rejected drafts leave the KV
blocks and the prefix cache intact. The draft's KV storage mirrors the target's blocks (kv_cache/groups.py
`mirror_groups`); its head may cover only the most frequent tokens (runner/draft_head.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from helpers.tiny_models import MOE_FAMILIES, make_draft
from test_speculative import COPY, GREEDY, PASSAGE, PROMPTS, WIDE, assert_sampled_alike, tokens

from edgeinfer.engine.config import EngineConfig
from edgeinfer.engine.kv_cache.groups import mirror_groups, plan_groups
from edgeinfer.engine.runner.draft_head import frequent_tokens
from edgeinfer.types import EngineRequest, SamplingParams

FAMILIES = ("llama", "qwen3", "gemma3")
SPEC = dict(num_speculative_tokens=4, speculative_max_batch=64)
SELF = dict(speculative_method="self", **SPEC)
# A smaller draft of the same vocabulary: the target with a layer left out and every weight perturbed (it
# agrees with the target often, not always); Gemma's keeps a sliding layer of a window the target lacks (it
# reads a full-attention group's blocks) and the full one.
DRAFT_SHAPES: dict[str, dict] = {
    "llama": dict(keep=[0]),
    "qwen3": dict(keep=[0]),
    "gemma3": dict(keep=[0, 2], sliding_window=4),
}
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def draft_models(tiny_models, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("drafts")
    made = {f: make_draft(Path(tiny_models[f]), root / f, noise=0.05, **DRAFT_SHAPES[f]) for f in FAMILIES}
    return {f: str(path) for f, path in made.items()}


def method_kw(method: str, family: str, draft_models: dict[str, str]) -> dict:
    if method == "self":
        return SELF
    return dict(speculative_method="draft", draft_model=draft_models[family], **SPEC)


def drafted_and_accepted(eng) -> tuple[int, int]:
    s = eng.stats()
    return sum(s.spec_drafted_by_source.values()), sum(s.spec_accepted_by_source.values())


@pytest.mark.parametrize("method", ["self", "draft"])
@pytest.mark.parametrize(
    "family,dtype", [*[(f, "float32") for f in FAMILIES], *[(f, "bfloat16") for f in ("llama", "gemma3")]]
)
def test_greedy_tokens_equal_without_speculation(
    method, family, dtype, tiny_models, draft_models, engine_factory
):
    model = tiny_models[family]
    plain = engine_factory(model, dtype=dtype)
    spec = engine_factory(model, dtype=dtype, **method_kw(method, family, draft_models))
    alone = [tokens(plain, [p])[0] for p in PROMPTS]
    assert [tokens(spec, [p])[0] for p in PROMPTS] == alone
    together = tokens(spec, PROMPTS)
    assert together == (alone if dtype == "float32" else tokens(plain, PROMPTS))
    drafted, accepted = drafted_and_accepted(spec)
    assert drafted > 0 and accepted > 0
    assert set(spec.stats().spec_drafted_by_source) == {method}
    if dtype == "bfloat16":  # the draft's decode steps and the verifying ones through the fused step
        assert spec.runner.draft.runner.fused is not None and spec.runner.fused is not None


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_self_speculation_keeps_the_moe_families_greedy_tokens(family, moe_models, engine_factory):
    """The mixture-of-experts families (Kimi's MLA layout among them) draft by their own int4 form too."""
    model = moe_models[family]
    plain = engine_factory(model)
    spec = engine_factory(model, **SELF)
    assert tokens(spec, PROMPTS) == [tokens(plain, [p])[0] for p in PROMPTS]
    drafted, accepted = drafted_and_accepted(spec)
    assert drafted > 0 and accepted > 0


@pytest.mark.parametrize("method", ["self", "draft"])
def test_chunked_prefill_preemption_and_prefix_hits(method, tiny_models, draft_models, engine_factory):
    """Chunked prompts (the draft prefills each chunk with the target), a pool so small that requests are
    preempted (recomputed) between speculative steps, and a second pass hitting the prefix cache (the
    draft's KV of the cached blocks is there): each prompt's tokens alone without speculation."""
    alone = engine_factory(tiny_models["gemma3"], enable_prefix_caching=False)
    expected = [tokens(alone, [p])[0] for p in PROMPTS]
    kw = method_kw(method, "gemma3", draft_models)
    tight = engine_factory(tiny_models["gemma3"], num_kv_blocks=24, max_num_batched_tokens=7, **kw)
    assert tokens(tight, PROMPTS) == expected
    assert tight.stats().num_preemptions > 0 and drafted_and_accepted(tight)[1] > 0
    cached = engine_factory(tiny_models["gemma3"], **kw)
    tokens(cached, PROMPTS)
    hits = cached.stats().prefix_cache_hits
    assert tokens(cached, PROMPTS) == expected and cached.stats().prefix_cache_hits > hits


def test_rejected_drafts_leave_blocks_and_prefix_cache_intact(tiny_models, draft_models, engine_factory):
    """The integrity check after every step of drafting, verifying and rolling back; afterwards, hits on
    what was generated give the uncached answer."""
    eng = engine_factory(tiny_models["gemma3"], **method_kw("draft", "gemma3", draft_models))
    for i, p in enumerate(PROMPTS):
        eng.add_request(EngineRequest(f"r{i}", p, GREEDY))
    while eng.has_unfinished_requests():
        eng.step()
        eng.check_integrity()
        for req in eng.scheduler.running:
            assert req.num_computed_tokens == req.num_tokens - 1
    drafted, accepted = drafted_and_accepted(eng)
    assert 0 < accepted < drafted
    generated = tokens(eng, PROMPTS)
    again = [p + g[:20] for p, g in zip(PROMPTS, generated, strict=True)]
    uncached = engine_factory(tiny_models["gemma3"], enable_prefix_caching=False)
    assert tokens(eng, again) == [tokens(uncached, [p])[0] for p in again]


def test_drafts_catch_up_on_what_was_computed_while_many_ran(tiny_models, draft_models, engine_factory):
    """Three requests, more than may speculate: no drafts and no draft prefill. Once the shortest finishes,
    the other two draft, the draft model first computing their whole context, and drafts are accepted."""
    model = tiny_models["gemma3"]
    kw = {**method_kw("draft", "gemma3", draft_models), "speculative_max_batch": 2}
    plain, spec = engine_factory(model), engine_factory(model, **kw)
    sps = [dataclasses.replace(GREEDY, max_tokens=n) for n in (3, 32, 32)]
    runs = {}
    for name, eng in (("plain", plain), ("spec", spec)):
        for i, (p, sp) in enumerate(zip(PROMPTS, sps, strict=True)):
            eng.add_request(EngineRequest(f"r{i}", p, sp))
        outs: dict[str, list[int]] = {}
        while eng.has_unfinished_requests():
            for o in eng.step():
                outs.setdefault(o.request_id, []).extend(o.new_token_ids)
        runs[name] = outs
    assert runs["spec"] == runs["plain"]
    assert drafted_and_accepted(spec)[1] > 0


def test_seeded_sampling_gives_the_same_tokens(tiny_models, engine_factory):
    sp = [SamplingParams(max_tokens=24, temperature=0.02, seed=i, ignore_eos=True) for i in range(8)]
    prompts = [COPY] * 8
    plain = engine_factory(tiny_models["llama"])
    spec = engine_factory(tiny_models["llama"], **SELF)
    assert tokens(spec, prompts, sp) == tokens(plain, prompts, sp)
    assert drafted_and_accepted(spec)[1] > 0


def test_unseeded_sampling_keeps_its_distribution(tiny_models, draft_models, engine_factory):
    """Many samples of the first tokens with and without a draft model's drafts: the same distribution."""
    plain = engine_factory(tiny_models["llama"], **WIDE)
    draft = {**method_kw("draft", "llama", draft_models), "speculative_max_batch": 256}
    spec = engine_factory(tiny_models["llama"], **WIDE, **draft)
    assert_sampled_alike(plain, spec, rounds=6)
    drafted, accepted = drafted_and_accepted(spec)
    assert accepted > 0.1 * drafted > 100  # both paths carry much of the output


def test_a_head_over_the_frequent_tokens_only(tiny_models, engine_factory):
    """A draft head of 48 of the 384 tokens: drafts come from those only, and the output is unchanged."""
    plain = engine_factory(tiny_models["qwen3"])
    spec = engine_factory(tiny_models["qwen3"], draft_vocab_size=48, **SELF)
    head = spec.runner.draft.head
    assert head.size == 48
    proposed: list[int] = []
    fill = spec.runner.draft.fill

    def recording(chunks, prefill):
        filled = fill(chunks, prefill)
        proposed.extend(t for c in filled for t in c.draft_token_ids)
        return filled

    spec.runner.draft.fill = recording
    assert tokens(spec, PROMPTS) == tokens(plain, PROMPTS)
    assert proposed and set(proposed) <= set(head.ids.tolist())


def test_frequent_tokens_puts_special_then_corpus_then_ids():
    assert frequent_tokens([9, 7, 9, 9, 7, 5, 50], {2}, vocab=12, size=6) == [2, 9, 7, 5, 0, 1]
    assert frequent_tokens([3], set(), vocab=4, size=10) == [3, 0, 1, 2]


def test_mirrored_groups_follow_the_targets_tables():
    windows = [8, 8, None, 8, 8, None]
    target = plan_groups(windows, 512)
    assert mirror_groups(target, windows, 512) == target  # the same model: the same groups
    draft = mirror_groups(target, [8, 4, None], 512)  # window 4: no such group, a full one serves it
    assert [(g.window, g.layers) for g in draft.groups] == [(8, (0,)), (8, ()), (None, (1, 2))]
    assert draft.slots == 2 and draft.group_of(1) == draft.group_of(2) == 2
    with pytest.raises(ValueError, match="no KV group"):
        mirror_groups(plan_groups([8, 8], 512), [None], 512)  # full attention over windowed tables only


def held_bytes(storage) -> int:
    return sum(
        t.numel() * t.element_size() for p in storage._pools for t in (p.data, p.scales) if t is not None
    )


@pytest.mark.parametrize("method", ["self", "draft"])
def test_the_drafts_kv_and_weights_come_out_of_the_budget(method, tiny_models, draft_models, engine_factory):
    budget = dict(kv_cache_memory_bytes=1 << 20, num_kv_blocks=None)
    plain = engine_factory(tiny_models["llama"], **budget)
    spec = engine_factory(
        tiny_models["llama"], kv_cache_memory_bytes=budget, **method_kw(method, "llama", draft_models)
    )
    draft = spec.runner.draft.runner
    # both models' pools, null block included, are what the layout counts, and within the budget
    allocated = held_bytes(spec.runner.storage) + held_bytes(draft.storage)
    assert allocated == (spec.layout.num_kv_blocks + 1) * spec.layout.kv_block_bytes
    assert spec.layout.kv_bytes <= budget["kv_cache_memory_bytes"]
    assert spec.layout.num_kv_blocks < plain.layout.num_kv_blocks
    draft_weights = sum(
        t.numel() * t.element_size() for t in [*draft.model.parameters(), *draft.model.buffers()]
    )
    assert spec.layout.weight_bytes == plain.layout.weight_bytes + draft_weights
    assert spec.memory_bytes() == spec.layout.weight_bytes + allocated - spec.layout.kv_block_bytes


def test_config_refuses_bad_draft_settings(tiny_models):
    with pytest.raises(ValueError, match="go together"):
        EngineConfig(model=tiny_models["llama"], speculative_method="draft")
    with pytest.raises(ValueError, match="go together"):
        EngineConfig(model=tiny_models["llama"], speculative_method="ngram", draft_model="x")
    with pytest.raises(ValueError, match="int4 form"):
        EngineConfig(model=tiny_models["llama"], speculative_method="self", quantization="int4")


@pytest.mark.gemma
def test_default_model_greedy_equal_with_self_speculation(default_gguf, engine_factory):
    """Gemma 3 270M in bf16, its int4 form drafting over its 65,536 most frequent tokens: the same tokens as
    without speculation (the request's opt-out), on a copy and on open text, with drafts accepted. The
    draft is rounded without activation-aware calibration here: a fresh cache would spend most of the
    test calibrating, and how a draft was made cannot change the tokens."""
    kw = dict(dtype="bfloat16", num_kv_blocks=64, block_size=16, max_num_batched_tokens=1024)
    kw["calibrate_quantization"] = False
    eng = engine_factory(str(default_gguf), **kw, speculative_method="self")
    prompts = [
        eng.tokenizer.encode(f"Repeat the text.\n{PASSAGE}\n{PASSAGE}\n{PASSAGE[:40]}"),
        eng.tokenizer.encode("The three most useful things to know about rivers are"),
    ]
    sp = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    for prompt in prompts:
        (a,) = eng.generate([prompt], dataclasses.replace(sp, speculative=False))
        (b,) = eng.generate([prompt], sp)
        assert (b.token_ids, b.text) == (a.token_ids, a.text)
    drafted, accepted = drafted_and_accepted(eng)
    assert accepted > 0.4 * drafted > 10
